//! The projection is the fold of the log, exactly once: incrementally maintained in any batch
//! sizes, it equals a full replay; a crash between batches resumes without skipping or doubling;
//! malformed events are counted and skipped; a corrupt projection is rebuilt.

use eventlog::{Append, EmbeddedLog, EventLog};
use ledger::{Envelope, StateConfig};
use projector::{Projector, Stats};

/// The ledger of a simulated run of the bundled Alibaba trace (about twenty thousand events).
fn alibaba_events() -> Vec<Envelope> {
    let out = tempfile::tempdir().unwrap();
    let spec = sim::bundled_alibaba(out.path(), Some("fairshare")).unwrap();
    sim::run(&spec, |_| {}).unwrap();
    sim::read_ledger(&out.path().join("events.jsonl")).unwrap()
}

/// `events` as envelopes a second apart from the epoch, numbered from 1.
fn one_a_second(events: impl IntoIterator<Item = ledger::Event>) -> Vec<Envelope> {
    events
        .into_iter()
        .enumerate()
        .map(|(i, e)| {
            Envelope::new(
                uuid::Uuid::from_u128(i as u128 + 1),
                1_000 * i as u64,
                "t",
                e,
            )
        })
        .collect()
}

async fn write_all(log: &EmbeddedLog, events: &[Envelope]) {
    let mut router = eventlog::subject::Router::default();
    for chunk in events.chunks(500) {
        let appends: Vec<Append> = chunk.iter().map(|e| router.append(e, None)).collect();
        log.append_batch(appends).await.unwrap();
    }
}

/// An allocation `lab` and a node `n` of two GPUs: where the hand-written ledgers run.
fn lab_and_node() -> [ledger::Event; 2] {
    use ledger::event::*;
    [
        ledger::Event::AllocationSet(AllocationSet {
            path: "lab".into(),
            weight: 1,
            max_gpus: None,
            max_pending_workloads: None,
            max_pending_gpus: None,
        }),
        ledger::Event::NodeRegistered(NodeRegistered {
            node: "n".into(),
            gpus: 2,
            model: "H100".into(),
            labels: Default::default(),
        }),
    ]
}

/// Workload `id` finished with exit code 0.
fn finished(id: uuid::Uuid) -> ledger::Event {
    ledger::Event::WorkloadFinished(ledger::event::WorkloadFinished {
        workload: id,
        exit_code: Some(0),
        signal: None,
        error: None,
    })
}

/// Workload `a` submitted with key `t/k1`, run and finished; then (6) `b` submitted with the
/// same key, a duplicate; (7) `a` submitted again; (8, 9) `a` cancelled and finished late.
fn late_about_an_ended_workload(a: uuid::Uuid, b: uuid::Uuid) -> Vec<ledger::Event> {
    use ledger::event::*;
    use ledger::Event;
    let keyed = |id| {
        let mut s = WorkloadSubmitted::new(id, Some("lab".into()), 1, 1);
        s.idempotency_key = Some("t/k1".into());
        Event::WorkloadSubmitted(s)
    };
    lab_and_node()
        .into_iter()
        .chain([
            keyed(a),
            Event::WorkloadStarted(WorkloadStarted {
                workload: a,
                placement: vec![PlacedNode {
                    node: "n".into(),
                    gpus: vec![0],
                }],
                protected_until_ms: 10_000,
                borrowed: None,
            }),
            finished(a),
            keyed(b),
            Event::WorkloadSubmitted(WorkloadSubmitted::new(a, Some("lab".into()), 1, 1)),
            Event::WorkloadCancelled(WorkloadCancelled {
                workload: a,
                reason: None,
            }),
            finished(a),
        ])
        .collect()
}

fn config() -> StateConfig {
    StateConfig::default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incremental_projection_equals_full_replay() {
    let events = alibaba_events();
    assert!(events.len() > 10_000, "{} events", events.len());
    let dir = tempfile::tempdir().unwrap();
    let log = EmbeddedLog::open(&dir.path().join("log")).unwrap();
    write_all(&log, &events).await;

    // Incrementally, in uneven steps, reopening now and then, with frequent checkpoints.
    let proj_dir = dir.path().join("incremental");
    let mut step = 1;
    let mut reopened = 0;
    loop {
        let mut p = Projector::open(&proj_dir, config(), &log)
            .await
            .unwrap()
            .checkpoint_every(977);
        for _ in 0..7 {
            step = step * 7 % 1013 + 1;
            p.project_next(&log, step).await.unwrap();
        }
        if p.last_seq() == events.len() as u64 {
            let (full, stats, last) = projector::replay(&log, &dir.path().join("full"), config())
                .await
                .unwrap();
            assert_eq!(last, events.len() as u64);
            assert_eq!(p.digest().unwrap(), full, "incremental != full replay");
            assert_eq!(p.stats(), stats);
            assert_eq!(stats.total(), last, "every event counted once");
            assert!(stats.applied > 10_000);
            // The in-memory state reached by checkpoints and refolds is the full fold (through
            // a book, which moves the clock hour by hour).
            let mut fresh = ledger::State::new(config());
            let mut book = ledger::book::Book::new();
            for (i, e) in events.iter().enumerate() {
                book.apply(&mut fresh, i as u64 + 1, e);
                book.link(i as u64 + 1, &serde_json::to_vec(e).unwrap());
            }
            let closed = book.take_closed();
            assert!(closed.len() > 100, "{} rows closed", closed.len());
            assert!(
                p.book() == &book,
                "the book reached by checkpoints and refolds differs"
            );
            // Every row the fresh fold closed is kept, as it closed it.
            assert_eq!(p.kept().all().unwrap().len(), closed.len());
            assert_eq!(p.state().last_seq(), fresh.last_seq());
            assert_eq!(p.state().workloads(), fresh.workloads());
            assert_eq!(p.state().counters(), fresh.counters());
            assert_eq!(p.state().rejections(), fresh.rejections());
            // The ended workloads are the projection's rows', not the state's to hold.
            assert!(p.state().ended().is_empty());
            assert!(fresh.ended().len() > 1_000, "{} ended", fresh.ended().len());
            for (&id, &phase) in fresh.ended() {
                assert_eq!(p.state().ended_phase(id), Some(phase));
            }
            break;
        }
        reopened += 1;
    }
    assert!(
        reopened > 3,
        "the projection should have been reopened along the way"
    );
}

#[tokio::test]
async fn rows_answer_for_workloads_and_allocations() {
    let events = alibaba_events();
    let dir = tempfile::tempdir().unwrap();
    let log = EmbeddedLog::open(&dir.path().join("log")).unwrap();
    write_all(&log, &events).await;
    let mut p = Projector::open(&dir.path().join("p"), config(), &log)
        .await
        .unwrap();
    p.catch_up(&log).await.unwrap();
    let finished = events
        .iter()
        .rev()
        .find_map(|e| match &e.event {
            ledger::Event::WorkloadFinished(f) => Some(f.workload),
            _ => None,
        })
        .unwrap();
    let row = p.workload(finished).unwrap().unwrap();
    assert_eq!(row.phase, ledger::Phase::Finished);
    assert!(row.starts >= 1 && row.placement.is_empty());
    let last_about = events
        .iter()
        .rposition(|e| e.event.workload() == Some(finished))
        .unwrap();
    assert_eq!(row.last_seq, last_about as u64 + 1);
    // Its history is every event about it, in order (a simulated ledger has no rejections).
    let about: Vec<u64> = events
        .iter()
        .enumerate()
        .filter(|(_, e)| e.event.workload() == Some(finished))
        .map(|(i, _)| i as u64 + 1)
        .collect();
    assert_eq!(row.history, about);
    assert_eq!(row.history.first(), Some(&row.submit_seq));
    assert_eq!(row.ended_at_ms, Some(events[last_about].occurred_at_ms));
    // Delivered GPU-hours per allocation agree with the fold's own accounting.
    let state = p.state();
    for a in &state.allocations().nodes {
        let row = p.allocation(&a.path).unwrap().unwrap();
        assert_eq!(row.delivered_gpu_ms, a.delivered_gpu_ms, "{}", a.path);
    }
    assert!(p.workload(uuid::Uuid::nil()).unwrap().is_none());
}

#[tokio::test]
async fn malformed_events_are_skipped_and_unknown_versions_rejected_by_the_fold() {
    let dir = tempfile::tempdir().unwrap();
    let log = EmbeddedLog::open(&dir.path().join("log")).unwrap();
    let events = alibaba_events();
    let mut router = eventlog::subject::Router::default();
    for e in &events[..50] {
        log.append(router.append(e, None)).await.unwrap();
    }
    log.append(Append::new("fairledger.ledger.junk", "{not json"))
        .await
        .unwrap();
    let mut future = serde_json::to_value(&events[50]).unwrap();
    future["schema_version"] = serde_json::json!(99);
    log.append(Append::new(
        "fairledger.ledger.future",
        serde_json::to_vec(&future).unwrap(),
    ))
    .await
    .unwrap();
    for e in &events[50..100] {
        log.append(router.append(e, None)).await.unwrap();
    }
    let mut p = Projector::open(&dir.path().join("p"), config(), &log)
        .await
        .unwrap();
    p.catch_up(&log).await.unwrap();
    let stats = p.stats();
    assert_eq!(stats.malformed, 1);
    assert_eq!(stats.total(), 102);
    assert_eq!(p.last_seq(), 102, "the projector went past them");
    let rejected = p.rejected().unwrap();
    let codes: Vec<_> = rejected
        .iter()
        .filter(|(seq, _)| (51..=52).contains(seq))
        .map(|(seq, r)| (*seq, r.code.as_str(), r.kind.is_some()))
        .collect();
    // Junk is skipped; an event of a future schema version is the fold's to reject, as it is
    // for every folder (the agents' too).
    assert_eq!(
        codes,
        vec![
            (51, "malformed", false),
            (52, "unsupported_schema_version", true)
        ]
    );
    assert_eq!(p.last_malformed().map(|m| m.0), Some(51));
    // The events after them were folded as if the bad ones were not there.
    let mut clean = ledger::State::new(config());
    for (i, e) in events[..100].iter().enumerate() {
        let seq = if i < 50 { i + 1 } else { i + 3 } as u64;
        clean.apply(seq, e);
    }
    assert_eq!(p.state().workloads(), clean.workloads());
}

#[tokio::test]
async fn a_corrupt_or_foreign_projection_is_rebuilt_from_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let log = EmbeddedLog::open(&dir.path().join("log")).unwrap();
    write_all(&log, &alibaba_events()[..2000]).await;
    let pdir = dir.path().join("p");
    let digest = {
        let mut p = Projector::open(&pdir, config(), &log)
            .await
            .unwrap()
            .checkpoint_every(500);
        p.catch_up(&log).await.unwrap();
        p.checkpoint().unwrap();
        p.digest().unwrap()
    };
    // Damage the checkpoint.
    {
        let db = eventlog::embedded::open_sled(sled::Config::new().path(&pdir)).unwrap();
        let tree = db.open_tree("checkpoint").unwrap();
        tree.insert(b"state", b"garbage".to_vec()).unwrap();
        db.flush().unwrap();
    }
    let err = Projector::open(&pdir, config(), &log).await.err().unwrap();
    assert!(err.is_rebuildable(), "{err}");
    assert!(err.to_string().contains("corrupt"), "{err}");
    let mut p = Projector::open_or_rebuild(&pdir, config(), &log)
        .await
        .unwrap();
    assert_eq!(p.last_seq(), 0, "rebuilt from scratch");
    p.catch_up(&log).await.unwrap();
    assert_eq!(p.digest().unwrap(), digest);
    drop(p);
    // Other settings: the simulated ledger sets its own in its first event, so the projection
    // opens as it was built whatever configuration is asked for...
    let other = StateConfig {
        window_ms: 3_600_000,
        ..config()
    };
    let p = Projector::open(&pdir, other, &log).await.unwrap();
    assert_eq!(p.digest().unwrap(), digest);
    drop(p);
    // ...but the projection of a log that sets none is rebuilt under other settings.
    let plain = EmbeddedLog::open(&dir.path().join("plain")).unwrap();
    write_all(&plain, &one_a_second(lab_and_node())).await;
    let plain_dir = dir.path().join("plain-p");
    Projector::open(&plain_dir, config(), &plain)
        .await
        .unwrap()
        .catch_up(&plain)
        .await
        .unwrap();
    let err = Projector::open(&plain_dir, other, &plain)
        .await
        .err()
        .unwrap();
    assert!(
        matches!(err, projector::ProjectionError::OtherSettings { .. }),
        "{err}"
    );
    // Settings the log changed are the log's, not other settings of the projection's: a
    // checkpoint taken after a `settings_set` opens again without a rebuild, and an offline
    // refold from the same starting configuration agrees with every kept row.
    let settled = EmbeddedLog::open(&dir.path().join("settled")).unwrap();
    let events = one_a_second(
        lab_and_node()
            .into_iter()
            .chain([ledger::Event::SettingsSet(ledger::settings::Settings {
                clock_skew_tolerance_ms: 1000,
                max_min_runtime_s: 12 * 3600,
                ..Default::default()
            })]),
    );
    write_all(&settled, &events).await;
    let sdir = dir.path().join("settled-p");
    {
        let mut p = Projector::open(&sdir, config(), &settled).await.unwrap();
        p.catch_up(&settled).await.unwrap();
        assert_eq!(p.state().config().min_runtime_cap_ms, 12 * 3_600_000);
        p.checkpoint().unwrap();
    }
    let p = Projector::open(&sdir, config(), &settled).await.unwrap();
    assert_eq!(
        p.last_seq(),
        events.len() as u64,
        "opened from its checkpoint"
    );
    assert_eq!(p.state().config().min_runtime_cap_ms, 12 * 3_600_000);
    let found = projector::verify::verify(
        &settled,
        &p.kept(),
        &projector::verify::open_rows_now(p.book(), p.state()),
        *p.state().base_config(),
        p.last_seq(),
        &Default::default(),
    )
    .await
    .unwrap();
    assert!(found.differences.is_empty(), "{:?}", found.differences);
    drop(p);
    // A projection ahead of the log belongs to another log.
    let empty = EmbeddedLog::open(&dir.path().join("empty")).unwrap();
    let err = Projector::open(&pdir, config(), &empty)
        .await
        .err()
        .unwrap();
    assert!(
        matches!(err, projector::ProjectionError::AheadOfLog { .. }),
        "{err}"
    );
}

#[test]
fn stats_total_counts_every_kind() {
    let s = Stats {
        applied: 1,
        rejected: 2,
        duplicates: 3,
        malformed: 4,
    };
    assert_eq!(s.total(), 10);
}

#[tokio::test]
async fn a_hole_in_the_log_stops_the_projector_before_it() {
    let dir = tempfile::tempdir().unwrap();
    let log = EmbeddedLog::open(&dir.path().join("log")).unwrap();
    let events = alibaba_events();
    let mut router = eventlog::subject::Router::default();
    let stored: Vec<eventlog::Stored> = events[..10]
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let a = router.append(e, None);
            eventlog::Stored {
                seq: i as u64 + 1,
                subject: a.subject,
                msg_id: a.msg_id,
                payload: a.payload,
            }
        })
        .collect();
    let mut p = Projector::open(&dir.path().join("p"), config(), &log)
        .await
        .unwrap();
    let with_hole: Vec<_> = stored[..4].iter().chain(&stored[5..]).cloned().collect();
    let err = p.apply(&with_hole).unwrap_err();
    assert!(
        matches!(
            err,
            projector::ProjectionError::Gap {
                expected: 5,
                got: 6
            }
        ),
        "{err}"
    );
    assert_eq!(p.last_seq(), 4, "applied up to the hole");
    assert_eq!(p.stats().total(), 4);
    // Given the missing event, it goes on.
    assert_eq!(p.apply(&stored[4..]).unwrap(), 6);
    assert_eq!(p.last_seq(), 10);
}

#[tokio::test]
async fn a_running_workload_cancelled_by_its_agents_stop_report_keeps_its_row() {
    use ledger::event::*;
    use ledger::Event;
    let dir = tempfile::tempdir().unwrap();
    let log = EmbeddedLog::open(&dir.path().join("log")).unwrap();
    let id = uuid::Uuid::from_u128(42);
    let events = lab_and_node().into_iter().chain([
        Event::WorkloadSubmitted(WorkloadSubmitted::new(id, Some("lab".into()), 2, 1)),
        Event::WorkloadStarted(WorkloadStarted {
            workload: id,
            placement: vec![PlacedNode {
                node: "n".into(),
                gpus: vec![0, 1],
            }],
            protected_until_ms: 10_000,
            borrowed: None,
        }),
        Event::PreemptionRequested(PreemptionRequested {
            workload: id,
            reason: PreemptionReason::UserCancelled,
            beneficiary: None,
            grace_s: 2,
        }),
        Event::WorkloadStopped(WorkloadStopped {
            workload: id,
            reason: StopReason::Cancelled,
        }),
    ]);
    write_all(&log, &one_a_second(events)).await;
    let mut p = Projector::open(&dir.path().join("p"), config(), &log)
        .await
        .unwrap();
    p.catch_up(&log).await.unwrap();
    assert_eq!(p.last_seq(), 6);
    let row = p.workload(id).unwrap().unwrap();
    assert_eq!(row.phase, ledger::Phase::Cancelled);
    assert_eq!(row.ended_at_ms, Some(5_000));
    assert!(row.placement.is_empty());
}

#[tokio::test]
async fn a_checkpoint_gap_holds_checkpoints_back_however_many_events_arrive() {
    let dir = tempfile::tempdir().unwrap();
    let log = EmbeddedLog::open(&dir.path().join("log")).unwrap();
    write_all(&log, &alibaba_events()[..3000]).await;
    let open = |name: &'static str, gap: u64| {
        let dir = dir.path().join(name);
        let log = &log;
        async move {
            Projector::open(&dir, config(), log)
                .await
                .unwrap()
                .checkpoint_every(500)
                .checkpoint_at_most_every(std::time::Duration::from_secs(gap))
        }
    };
    let (mut eager, mut held) = (open("eager", 0).await, open("held", 3600).await);
    for _ in 0..6 {
        eager.project_next(&log, 500).await.unwrap();
        held.project_next(&log, 500).await.unwrap();
    }
    assert_eq!(eager.checkpoint_seq().unwrap(), Some(3000));
    assert_eq!(held.checkpoint_seq().unwrap(), None);
    // An explicit checkpoint (on shutdown) is written regardless.
    held.checkpoint().unwrap();
    assert_eq!(held.checkpoint_seq().unwrap(), Some(3000));
}

/// The events about a workload that the fold refuses are kept on its row, before and after it
/// ends, the same however the events are split into batches (and so the digest is too).
#[tokio::test]
async fn refused_events_stay_on_the_row_however_the_batches_fall() {
    use ledger::event::*;
    use ledger::Event;
    let dir = tempfile::tempdir().unwrap();
    let log = EmbeddedLog::open(&dir.path().join("log")).unwrap();
    let id = uuid::Uuid::from_u128(7);
    let events = lab_and_node().into_iter().chain([
        Event::WorkloadSubmitted(WorkloadSubmitted::new(id, Some("lab".into()), 1, 1)),
        // 4: refused, it is not running yet.
        finished(id),
        Event::WorkloadStarted(WorkloadStarted {
            workload: id,
            placement: vec![PlacedNode {
                node: "n".into(),
                gpus: vec![0],
            }],
            protected_until_ms: 10_000,
            borrowed: None,
        }),
        finished(id),
        // 7 and 8: refused, it has ended.
        finished(id),
        finished(id),
    ]);
    write_all(&log, &one_a_second(events)).await;
    let stored = log.read(1, 100).await.unwrap();
    let mut digests = Vec::new();
    for split in [1, 3, 8] {
        let mut p = Projector::open(&dir.path().join(format!("p{split}")), config(), &log)
            .await
            .unwrap();
        for chunk in stored.chunks(split) {
            p.apply(chunk).unwrap();
        }
        let row = p.workload(id).unwrap().unwrap();
        assert_eq!(row.phase, ledger::Phase::Finished);
        assert_eq!(row.history, vec![3, 5, 6], "batches of {split}");
        assert_eq!(row.rejected, vec![4, 7, 8], "batches of {split}");
        digests.push(p.digest().unwrap());
    }
    assert!(digests.windows(2).all(|w| w[0] == w[1]), "{digests:?}");
}

/// The state lends the workloads that ended and the keys used to the projection's rows once
/// each batch is written: it holds none of them, yet late events about an ended workload and
/// a key used again get the verdicts a fold holding them all gives, however the batches fall
/// and when refolding from a checkpoint older than the rows.
#[tokio::test]
async fn ended_workloads_and_used_keys_are_kept_in_rows_not_in_memory() {
    use ledger::Phase;
    let dir = tempfile::tempdir().unwrap();
    let log = EmbeddedLog::open(&dir.path().join("log")).unwrap();
    let (a, b) = (uuid::Uuid::from_u128(1), uuid::Uuid::from_u128(2));
    let envelopes = one_a_second(late_about_an_ended_workload(a, b));
    write_all(&log, &envelopes).await;
    let stored = log.read(1, 100).await.unwrap();
    let mut fresh = ledger::State::new(config());
    for (i, e) in envelopes.iter().enumerate() {
        fresh.apply(i as u64 + 1, e);
    }
    assert_eq!(fresh.ended_phase(a), Some(Phase::Finished));
    assert!(
        fresh.rejections().values().sum::<u64>() == 3,
        "{:?}",
        fresh.rejections()
    );
    let same_verdicts = |p: &Projector, how: &str| {
        assert_eq!(p.state().rejections(), fresh.rejections(), "{how}");
        assert_eq!(p.stats().duplicates, 1, "{how}");
        assert_eq!(p.stats().rejected, 3, "{how}");
        assert!(
            p.state().ended().is_empty(),
            "{how}: the state holds an ended workload"
        );
        assert_eq!(p.state().ended_phase(a), Some(Phase::Finished), "{how}");
        assert_eq!(p.state().idempotent("t/k1"), Some(a), "{how}");
        assert_eq!(p.state().ended_phase(b), None, "{how}");
        assert_eq!(p.state().idempotent("t/k2"), None, "{how}");
    };
    let mut digests = Vec::new();
    for split in [1, 3, 9] {
        let mut p = Projector::open(&dir.path().join(format!("p{split}")), config(), &log)
            .await
            .unwrap();
        for chunk in stored.chunks(split) {
            p.apply(chunk).unwrap();
        }
        same_verdicts(&p, &format!("batches of {split}"));
        digests.push(p.digest().unwrap());
        // Caught up in batches written behind the fold: while a batch is on its way its rows
        // and keys answer the fold's lookups.
        let mut p = Projector::open(&dir.path().join(format!("b{split}")), config(), &log)
            .await
            .unwrap()
            .catch_up_batch(split);
        p.catch_up(&log).await.unwrap();
        same_verdicts(&p, &format!("caught up in batches of {split}"));
        digests.push(p.digest().unwrap());
    }
    assert!(digests.windows(2).all(|w| w[0] == w[1]), "{digests:?}");

    // A checkpoint taken before the workload ended (but after its key was lent), and rows
    // written up to the end: the refold after the checkpoint must not take the later rows
    // for history it has not reached.
    let at = dir.path().join("checkpointed");
    let mut p = Projector::open(&at, config(), &log)
        .await
        .unwrap()
        .checkpoint_every(1_000);
    p.apply(&stored[..4]).unwrap();
    p.checkpoint().unwrap();
    p.apply(&stored[4..]).unwrap();
    drop(p);
    let p = Projector::open(&at, config(), &log).await.unwrap();
    assert_eq!(p.checkpoint_seq().unwrap(), Some(4));
    same_verdicts(&p, "refolded from the checkpoint at 4");
    // And from no checkpoint at all.
    let at = dir.path().join("unchecked");
    let mut p = Projector::open(&at, config(), &log)
        .await
        .unwrap()
        .checkpoint_every(1_000);
    p.apply(&stored).unwrap();
    drop(p);
    let p = Projector::open(&at, config(), &log).await.unwrap();
    assert_eq!(p.checkpoint_seq().unwrap(), None);
    same_verdicts(&p, "refolded from the start");
}

#[tokio::test]
async fn workloads_are_listed_newest_first_in_pages_with_their_runs() {
    use ledger::event::*;
    use ledger::Event;
    use projector::WorkloadFilter;
    let dir = tempfile::tempdir().unwrap();
    let log = EmbeddedLog::open(&dir.path().join("log")).unwrap();
    let (a, b, c) = (
        uuid::Uuid::from_u128(1),
        uuid::Uuid::from_u128(2),
        uuid::Uuid::from_u128(3),
    );
    let start = |id| {
        Event::WorkloadStarted(WorkloadStarted {
            workload: id,
            placement: vec![PlacedNode {
                node: "n".into(),
                gpus: vec![0, 1],
            }],
            protected_until_ms: 100_000,
            borrowed: None,
        })
    };
    let first_run = lab_and_node().into_iter().chain([
        Event::WorkloadSubmitted(WorkloadSubmitted {
            name: Some("train".into()),
            ..WorkloadSubmitted::new(a, Some("lab".into()), 2, 1)
        }),
        start(a),
        Event::WorkloadStopped(WorkloadStopped {
            workload: a,
            reason: StopReason::Lost,
        }),
    ]);
    // Its second run: 4 s, ending with exit code 2.
    let second_run = [
        Event::WorkloadRequeued(WorkloadRequeued {
            workload: a,
            work_lost_s: 0,
        }),
        start(a),
        Event::WorkloadSubmitted(WorkloadSubmitted::new(b, Some("lab".into()), 2, 1)),
        Event::WorkloadSubmitted(WorkloadSubmitted::new(c, None, 1, 1)),
        Event::WorkloadCancelled(WorkloadCancelled {
            workload: c,
            reason: None,
        }),
        Event::WorkloadFinished(WorkloadFinished {
            workload: a,
            exit_code: Some(2),
            signal: None,
            error: None,
        }),
    ];
    let events = one_a_second(first_run.chain(second_run));
    write_all(&log, &events[..5]).await;
    let path = dir.path().join("p");
    {
        let mut p = Projector::open(&path, config(), &log).await.unwrap();
        p.catch_up(&log).await.unwrap();
        assert_eq!(p.stats().rejected, 0, "{:?}", p.rejected().unwrap());
        let row = p.workload(a).unwrap().unwrap();
        assert_eq!((row.phase, row.run_ms), (ledger::Phase::Stopped, 1_000));
        assert_eq!(row.state_code(), "RQ");
    }
    // Reopened, the rest folds onto what the stored row carries.
    write_all(&log, &events[5..]).await;
    let mut p = Projector::open(&path, config(), &log).await.unwrap();
    p.catch_up(&log).await.unwrap();
    assert_eq!(p.stats().rejected, 0, "{:?}", p.rejected().unwrap());
    let row = p.workload(a).unwrap().unwrap();
    assert_eq!(row.name.as_deref(), Some("train"));
    assert_eq!(
        row.run_ms,
        1_000 + 4_000,
        "two runs: 3 s to 4 s and 6 s to 10 s"
    );
    assert_eq!(row.run_ms_at(1_000_000), row.run_ms, "it is not running");
    assert_eq!(row.ran_on, ["n"]);
    assert_eq!(row.state_code(), "F");
    assert_eq!(
        row.output_log().unwrap(),
        format!("runs/{a}-2/output.log"),
        "its second run's"
    );
    assert_eq!(p.workload(c).unwrap().unwrap().state_code(), "CA");

    let kept = p.kept();
    let ids = |page: &projector::WorkloadPage| page.rows.iter().map(|r| r.id).collect::<Vec<_>>();
    let all = WorkloadFilter::default();
    let first = kept.workloads(&all, None, 2, 100).unwrap();
    assert_eq!(ids(&first), [c, b]);
    let second = kept.workloads(&all, first.next, 2, 100).unwrap();
    assert_eq!((ids(&second), second.next), (vec![a], None));
    let finished = WorkloadFilter {
        phases: vec![ledger::Phase::Finished],
        ..Default::default()
    };
    // A budget of one row read answers an empty page that says where to go on.
    let short = kept.workloads(&finished, None, 10, 1).unwrap();
    assert_eq!((short.rows.len(), short.scanned), (0, 1));
    let rest = kept.workloads(&finished, short.next, 10, 100).unwrap();
    assert_eq!(ids(&rest), [a]);
    let in_lab = WorkloadFilter {
        allocation: Some("lab".into()),
        ..Default::default()
    };
    assert_eq!(
        ids(&kept.workloads(&in_lab, None, 10, 100).unwrap()),
        [b, a]
    );
    let not_lab_prefix = WorkloadFilter {
        allocation: Some("la".into()),
        ..Default::default()
    };
    assert!(kept
        .workloads(&not_lab_prefix, None, 10, 100)
        .unwrap()
        .rows
        .is_empty());
    // Live at 9 s or ended since: the cancel at 8 s is out; submitted before 7 s: only a.
    let window = WorkloadFilter {
        since_ms: Some(9_000),
        until_ms: Some(7_000),
        ..Default::default()
    };
    assert_eq!(ids(&kept.workloads(&window, None, 10, 100).unwrap()), [a]);
}

/// Every workload the ledger of `events` submits, in id order.
fn submitted(events: &[Envelope]) -> Vec<uuid::Uuid> {
    let mut ids: Vec<uuid::Uuid> = events
        .iter()
        .filter_map(|e| match &e.event {
            ledger::Event::WorkloadSubmitted(s) => Some(s.workload),
            _ => None,
        })
        .collect();
    ids.sort();
    ids.dedup();
    ids
}

/// `a` and `b` answer the same for every workload: its row, the phase the fold knows it ended
/// in, and every listing page (in pages of several sizes, with and without filters).
fn same_rows(a: &Projector, b: &Projector, ids: &[uuid::Uuid], how: &str) {
    use projector::WorkloadFilter;
    assert_eq!(a.digest().unwrap(), b.digest().unwrap(), "{how}: digests");
    for &id in ids {
        assert_eq!(
            a.workload(id).unwrap(),
            b.workload(id).unwrap(),
            "{how}: {id}"
        );
        assert_eq!(
            a.state().ended_phase(id),
            b.state().ended_phase(id),
            "{how}: {id}"
        );
    }
    let filters = [
        WorkloadFilter::default(),
        WorkloadFilter {
            phases: vec![ledger::Phase::Finished, ledger::Phase::Pending],
            ..Default::default()
        },
        WorkloadFilter {
            since_ms: Some(1_000 * ids.len() as u64),
            ..Default::default()
        },
    ];
    for filter in &filters {
        for (limit, budget) in [(7, 20), (100, 1_000), (1_000, 100)] {
            let (mut before, mut pages) = (None, 0);
            loop {
                let pa = a.kept().workloads(filter, before, limit, budget).unwrap();
                let pb = b.kept().workloads(filter, before, limit, budget).unwrap();
                assert_eq!(pa, pb, "{how}: {filter:?} before {before:?}");
                pages += 1;
                match pa.next {
                    Some(next) => before = Some(next),
                    None => break,
                }
            }
            assert!(pages > 1, "{how}: one page of {limit}");
        }
    }
}

/// Ended workloads' rows are packed a few dozen to a key as the fold goes (sled's memory grows
/// with its keys), and every read answers as from rows one to a key; an event refused about a
/// packed workload is noted on its row where it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn packed_rows_read_as_rows_one_to_a_key() {
    let mut events = alibaba_events();
    let ids = submitted(&events);
    let dir = tempfile::tempdir().unwrap();
    let log = EmbeddedLog::open(&dir.path().join("log")).unwrap();
    write_all(&log, &events).await;
    let mut plain = Projector::open(&dir.path().join("plain"), config(), &log)
        .await
        .unwrap()
        .pack_lag(None);
    plain.catch_up(&log).await.unwrap();
    assert_eq!(plain.stored_rows().unwrap(), (ids.len(), 0));
    // Packing at many points: in uneven batches, reopened along the way.
    let path = dir.path().join("packed");
    let mut step = 1;
    let packed = loop {
        let mut p = Projector::open(&path, config(), &log).await.unwrap();
        for _ in 0..5 {
            step = step * 7 % 1013 + 1;
            p.project_next(&log, step).await.unwrap();
        }
        if p.last_seq() == events.len() as u64 {
            break p;
        }
    };
    let (singles, packs) = packed.stored_rows().unwrap();
    assert!(
        packs > 0 && singles < ids.len(),
        "{singles} singles and {packs} packs for {} workloads",
        ids.len()
    );
    same_rows(&plain, &packed, &ids, "packed as it went");
    // Caught up in batches written behind the fold, packing as it goes, with checkpoints
    // taken while batches are on their way: the same rows, and it opens again from them.
    let behind_path = dir.path().join("behind");
    let mut behind = Projector::open(&behind_path, config(), &log)
        .await
        .unwrap()
        .catch_up_batch(313)
        .checkpoint_every(500);
    behind.catch_up(&log).await.unwrap();
    assert!(behind.stored_rows().unwrap().1 > 0, "nothing was packed");
    same_rows(&plain, &behind, &ids, "caught up behind the fold");
    drop(behind);
    let mut behind = Projector::open(&behind_path, config(), &log)
        .await
        .unwrap()
        .catch_up_batch(313);
    assert!(behind.checkpoint_seq().unwrap() > Some(10_000));
    same_rows(&plain, &behind, &ids, "reopened");

    // The first workloads ran for most of the trace and held packing back (the trace is
    // shorter than the lag): what is left is packed with the next batches. Here they are late
    // events about the first workload, long ended and packed, each refused and noted on its
    // row in its pack.
    let first = ids[0];
    let mut packed = packed;
    for k in 1..=4 {
        let late = Envelope::new(
            uuid::Uuid::from_u128(u128::MAX - k),
            events.last().unwrap().occurred_at_ms,
            "t",
            finished(first),
        );
        write_all(&log, std::slice::from_ref(&late)).await;
        events.push(late);
        packed.catch_up(&log).await.unwrap();
        behind.catch_up(&log).await.unwrap();
    }
    plain.catch_up(&log).await.unwrap();
    let row = packed.workload(first).unwrap().unwrap();
    let n = events.len() as u64;
    assert_eq!(
        row.rejected[row.rejected.len() - 4..],
        [n - 3, n - 2, n - 1, n]
    );
    let (singles, packs) = packed.stored_rows().unwrap();
    assert!(
        singles * 20 < ids.len() && packs * 64 >= ids.len() - singles,
        "{singles} singles and {packs} packs for {} workloads",
        ids.len()
    );
    same_rows(&plain, &packed, &ids, "after refused events");
    same_rows(&plain, &behind, &ids, "after refused events, behind");
}

/// A workload that waits long does not hold packing back for ever: past `lag` events packing
/// goes on beyond it, its row stays one to a key, and it reads right before and after it ends.
#[tokio::test]
async fn a_long_wait_holds_packing_back_only_so_long() {
    use ledger::event::*;
    use ledger::Event;
    let waiting = uuid::Uuid::from_u128(1);
    let mut events = vec![Event::WorkloadSubmitted(WorkloadSubmitted::new(
        waiting,
        Some("lab".into()),
        2,
        1,
    ))];
    for k in 2..=301u64 {
        let id = uuid::Uuid::from_u128(k.into());
        events.extend([
            Event::WorkloadSubmitted(WorkloadSubmitted::new(id, Some("lab".into()), 1, 1)),
            Event::WorkloadStarted(WorkloadStarted {
                workload: id,
                placement: vec![PlacedNode {
                    node: "n".into(),
                    gpus: vec![0],
                }],
                // Events are a second apart from the epoch: this one is at 3k - 2 s.
                protected_until_ms: 3_000 * k + 60_000,
                borrowed: None,
            }),
            finished(id),
        ]);
    }
    let cancel = Event::WorkloadCancelled(WorkloadCancelled {
        workload: waiting,
        reason: None,
    });
    let events = one_a_second(lab_and_node().into_iter().chain(events).chain([cancel]));
    let ids = submitted(&events);
    let dir = tempfile::tempdir().unwrap();
    let log = EmbeddedLog::open(&dir.path().join("log")).unwrap();
    write_all(&log, &events).await;
    let stored = log.read(1, 10_000).await.unwrap();
    let (before_cancel, cancel) = stored.split_at(stored.len() - 1);
    let open = |name: &str, lag| {
        let path = dir.path().join(name);
        let log = &log;
        async move {
            Projector::open(&path, config(), log)
                .await
                .unwrap()
                .pack_lag(lag)
        }
    };
    let mut plain = open("plain", None).await;
    let mut held = open("held", Some(1_000_000)).await;
    let mut passed = open("passed", Some(100)).await;
    for chunk in before_cancel.chunks(50) {
        for p in [&mut plain, &mut held, &mut passed] {
            p.apply(chunk).unwrap();
        }
    }
    assert_eq!(
        plain.stats().rejected,
        0,
        "{:?}",
        plain.rejected().unwrap().first()
    );
    // The waiting workload is the first row: within the lag nothing is packed.
    assert_eq!(held.stored_rows().unwrap(), (301, 0));
    let (singles, packs) = passed.stored_rows().unwrap();
    assert!(
        packs >= 4 && singles < 64,
        "{singles} singles, {packs} packs"
    );
    let row = passed.workload(waiting).unwrap().unwrap();
    assert_eq!(row.phase, ledger::Phase::Pending);
    same_rows(&plain, &held, &ids, "held back");
    same_rows(&plain, &passed, &ids, "passed");
    for p in [&mut plain, &mut held, &mut passed] {
        p.apply(cancel).unwrap();
    }
    assert_eq!(
        passed.workload(waiting).unwrap().unwrap().phase,
        ledger::Phase::Cancelled
    );
    same_rows(&plain, &passed, &ids, "the long wait ended");
    // An event about a packed workload is refused and noted on its row, which stays in its
    // pack.
    let second = uuid::Uuid::from_u128(2);
    let late = Envelope::new(
        uuid::Uuid::from_u128(u128::MAX),
        1_000 * events.len() as u64,
        "t",
        finished(second),
    );
    write_all(&log, std::slice::from_ref(&late)).await;
    let late = log.read(stored.len() as u64 + 1, 1).await.unwrap();
    let before = passed.stored_rows().unwrap();
    for p in [&mut plain, &mut passed] {
        p.apply(&late).unwrap();
    }
    assert_eq!(passed.stored_rows().unwrap(), before);
    let row = passed.workload(second).unwrap().unwrap();
    assert_eq!(row.rejected, [late[0].seq]);
    same_rows(&plain, &passed, &ids, "a refused event about a packed row");
    // Reopened, where packing reached is read back, and the rows with it.
    drop(passed);
    let passed = open("passed", Some(100)).await;
    assert_eq!(passed.stored_rows().unwrap().1, packs);
    same_rows(&plain, &passed, &ids, "reopened");
}

/// The checkpoint a shared projection refolds beside its fold (from the checkpoint before and
/// the log, so the fold never waits for a copy of its state) is the fold's own state and book
/// at that sequence.
async fn checkpoint_beside_is_the_folds(p: &Projector, log: &EmbeddedLog, how: &str) {
    p.checkpoint_beside(log).unwrap();
    let (state, book) = p.stored_checkpoint().unwrap().expect("a checkpoint");
    assert_eq!(state.last_seq(), p.last_seq(), "{how}");
    assert!(
        state == *p.state(),
        "{how}: the refolded state differs from the fold's at {}",
        p.last_seq()
    );
    assert!(
        book == *p.book(),
        "{how}: the refolded book differs from the fold's at {}",
        p.last_seq()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_refolded_beside_the_fold_is_the_folds_state() {
    // A simulated run, in uneven batches, with rows packed meanwhile.
    let dir = tempfile::tempdir().unwrap();
    let log = EmbeddedLog::open(&dir.path().join("log")).unwrap();
    write_all(&log, &alibaba_events()).await;
    let mut p = Projector::open(&dir.path().join("sim"), config(), &log)
        .await
        .unwrap()
        .checkpoint_every(u64::MAX)
        .pack_lag(Some(500));
    let mut checkpoints = 0;
    for size in [1, 2_999, 7, 5_003, 1_500].into_iter().cycle() {
        if p.project_next(&log, size).await.unwrap() == 0 {
            break;
        }
        checkpoint_beside_is_the_folds(&p, &log, "simulated run").await;
        checkpoints += 1;
    }
    assert!(checkpoints > 4, "{checkpoints} checkpoints");
    assert!(p.stored_rows().unwrap().1 > 0, "nothing was packed");

    // Late events about ended workloads and a key used again, refolded from a checkpoint that
    // is older than the rows that answer for them.
    let dir = tempfile::tempdir().unwrap();
    let log = EmbeddedLog::open(&dir.path().join("log")).unwrap();
    let (a, b) = (uuid::Uuid::from_u128(1), uuid::Uuid::from_u128(2));
    write_all(&log, &one_a_second(late_about_an_ended_workload(a, b))).await;
    let stored = log.read(1, 100).await.unwrap();
    for first in 1..stored.len() {
        let mut p = Projector::open(&dir.path().join(format!("p{first}")), config(), &log)
            .await
            .unwrap()
            .checkpoint_every(u64::MAX);
        p.apply(&stored[..first]).unwrap();
        checkpoint_beside_is_the_folds(&p, &log, &format!("first at {first}")).await;
        p.apply(&stored[first..]).unwrap();
        checkpoint_beside_is_the_folds(&p, &log, &format!("then from {first}")).await;
        assert_eq!(p.stats().rejected, 3);
    }
}
