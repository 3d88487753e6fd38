//! Two schedulers deciding on the same log can never both place from stale state: the second
//! to append finds the log moved and gets a conflict, on the embedded log and on JetStream. A
//! submission arriving between deciding and appending does not stop the decisions, and a
//! scheduler whose starts fence cannot hold falls back to the log's.

use eventlog::testing::NatsServer;
use eventlog::{Append, EmbeddedLog, EventLog, JetStreamLog, JetStreamOptions};
use ledger::event::*;
use ledger::{Envelope, StateConfig};
use projector::Projector;
use scheduler::{appends, pass, step, Fence, SchedulerConfig};
use tokio::sync::RwLock;
use uuid::Uuid;

/// The append of `event` at `at_ms`, written by a test, about the allocation `team`.
fn append(at_ms: u64, event: Event) -> Append {
    Append::event(
        &Envelope::new(Uuid::now_v7(), at_ms, "test", event),
        Some("team"),
        None,
    )
}

/// `nodes` nodes of 8 GPUs and the allocation `team`.
async fn cluster<L: EventLog>(log: &L, nodes: u32) {
    let mut events: Vec<Append> = (0..nodes)
        .map(|n| {
            let node = NodeRegistered {
                node: format!("n{n}"),
                gpus: 8,
                model: "H100".into(),
                labels: Default::default(),
            };
            append(1_000, Event::NodeRegistered(node))
        })
        .collect();
    let team = AllocationSet {
        path: "team".into(),
        weight: 1,
        max_gpus: None,
        max_pending_workloads: None,
        max_pending_gpus: None,
    };
    events.push(append(1_000, Event::AllocationSet(team)));
    log.append_batch(events).await.unwrap();
}

/// A projection of the whole log in `dir`.
async fn caught_up<L: EventLog>(log: &L, dir: &std::path::Path) -> Projector {
    let mut p = Projector::open(dir, StateConfig::default(), log)
        .await
        .unwrap();
    p.catch_up(log).await.unwrap();
    p
}

async fn race<L: EventLog>(log: &L, dir: &std::path::Path) {
    cluster(log, 2).await;
    let submissions: Vec<Append> = (0..12u64)
        .map(|i| {
            let w = WorkloadSubmitted::new(
                Uuid::from_u64_pair(7, i),
                Some("team".into()),
                [1, 2, 4][i as usize % 3],
                1,
            );
            append(1_000, Event::WorkloadSubmitted(w))
        })
        .collect();
    log.append_batch(submissions).await.unwrap();
    let config = SchedulerConfig::default();
    let (a, b) = (
        RwLock::new(caught_up(log, &dir.join("a")).await),
        RwLock::new(caught_up(log, &dir.join("b")).await),
    );
    let mut conflicts = 0;
    let mut appended = 0;
    for round in 0..10u64 {
        let now = 2_000 + round * 1_000;
        // Both decide on the same state; only the first append may land.
        let first = step(log, &a, &config, now, Fence::Starts).await.unwrap();
        let second = step(log, &b, &config, now, Fence::Starts).await.unwrap();
        if first.appended > 0 {
            assert!(second.conflict, "round {round}: both schedulers appended");
            assert_eq!(second.appended, 0);
            conflicts += 1;
        }
        appended += first.appended + second.appended;
        a.write().await.catch_up(log).await.unwrap();
        b.write().await.catch_up(log).await.unwrap();
    }
    assert!(conflicts > 0 && appended > 0);
    let p = a.read().await;
    assert_eq!(
        p.stats().rejected,
        0,
        "a decision was rejected: {:?}",
        p.rejected()
    );
    // 16 GPUs, demands of 1, 2 and 4: everything that fits was placed, nothing twice.
    let held: u64 = p.state().running_workloads().map(|w| w.gpus()).sum();
    assert_eq!(held, p.state().cluster().allocated_gpus);
    assert!((14..=16).contains(&held), "{held} GPUs held");
    assert_eq!(b.read().await.digest().unwrap(), p.digest().unwrap());
}

/// Decides on a caught-up projection, then lets `meanwhile` append before the decisions go
/// out fenced by `fence`: whether they landed.
async fn decide_then_append<L: EventLog>(
    log: &L,
    dir: &std::path::Path,
    meanwhile: Append,
    fence: Fence,
) -> bool {
    let mut p = caught_up(log, dir).await;
    let config = SchedulerConfig::default();
    let events = pass(p.state(), 2_000, &config);
    assert!(!events.is_empty(), "nothing to decide");
    let decisions = appends(p.state(), events, 2_000, "scheduler", fence);
    log.append(meanwhile).await.unwrap();
    match log.append_batch(decisions).await {
        Ok(_) => {
            p.catch_up(log).await.unwrap();
            assert_eq!(p.stats().rejected, 0, "{:?}", p.rejected());
            assert!(p.state().running_workloads().count() > 0);
            true
        }
        Err(eventlog::AppendError::Conflict { .. }) => false,
        Err(e) => panic!("{e}"),
    }
}

fn submission(i: u64) -> Append {
    let w = WorkloadSubmitted::new(Uuid::from_u64_pair(8, i), Some("team".into()), 1, 1);
    append(1_500, Event::WorkloadSubmitted(w))
}

async fn fences<L: EventLog>(log: &L, dir: &std::path::Path) {
    cluster(log, 4).await;
    // Each round places a fresh 1-GPU submission, with another one arriving in between.
    log.append(submission(1)).await.unwrap();
    assert!(!decide_then_append(log, &dir.join("a"), submission(2), Fence::Log).await);
    assert!(decide_then_append(log, &dir.join("b"), submission(3), Fence::Starts).await);
    // A cancel in between: the start lands, and the fold rejects it (the cancel won).
    log.append(submission(5)).await.unwrap();
    let mut p = caught_up(log, &dir.join("e")).await;
    let config = SchedulerConfig::default();
    let events = pass(p.state(), 2_500, &config);
    let five = Uuid::from_u64_pair(8, 5);
    assert!(events
        .iter()
        .any(|e| matches!(e, Event::WorkloadStarted(s) if s.workload == five)));
    let decisions = appends(p.state(), events, 2_500, "scheduler", Fence::Starts);
    let cancel = WorkloadCancelled {
        workload: five,
        reason: None,
    };
    log.append(append(2_400, Event::WorkloadCancelled(cancel)))
        .await
        .unwrap();
    log.append_batch(decisions).await.unwrap();
    p.catch_up(log).await.unwrap();
    let rejected = p.rejected().unwrap();
    assert_eq!(rejected.len(), 1, "{rejected:?}");
    assert_eq!(rejected[0].1.code, "wrong_phase");
    assert!(rejected[0].1.message.contains(&five.to_string()));
    let row = p.workload(five).unwrap().unwrap();
    assert_eq!(row.phase, ledger::Phase::Cancelled);
    // Something on the starts subjects that is not a start the state can fold: the starts
    // fence can never hold again, and the loop's fallback (the log's fence) does.
    log.append(submission(6)).await.unwrap();
    let odd = Append::new("fairledger.ledger.workload.started.team", "not an event");
    assert!(!decide_then_append(log, &dir.join("c"), odd, Fence::Starts).await);
    let p = RwLock::new(caught_up(log, &dir.join("d")).await);
    let mut conflicts = 0;
    let landed = loop {
        let passed = step(log, &p, &config, 3_000, Fence::after_conflicts(conflicts))
            .await
            .unwrap();
        if passed.appended > 0 {
            break conflicts;
        }
        assert!(
            passed.conflict && conflicts < 4,
            "{passed:?} after {conflicts}"
        );
        conflicts += 1;
    };
    assert_eq!(landed, 2, "the log's fence comes second");
    // The fallback's own placement puts the starts fence back in step.
    log.append(submission(4)).await.unwrap();
    let mut p = p.into_inner();
    p.catch_up(log).await.unwrap();
    let events = pass(p.state(), 4_000, &config);
    assert!(!events.is_empty(), "nothing to decide");
    let decisions = appends(p.state(), events, 4_000, "scheduler", Fence::Starts);
    log.append_batch(decisions).await.unwrap();
}

#[test]
fn the_fence_falls_back_to_the_log_every_other_pass_from_the_second_conflict() {
    let fences: Vec<Fence> = (0..6).map(Fence::after_conflicts).collect();
    use Fence::{Log, Starts};
    assert_eq!(fences, [Starts, Starts, Log, Starts, Log, Starts]);
}

/// One test of `scenario` on the embedded log and one on JetStream.
macro_rules! on_both_logs {
    ($scenario:ident: $embedded:ident, $jetstream:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $embedded() {
            let dir = tempfile::tempdir().unwrap();
            let log = EmbeddedLog::open(&dir.path().join("log")).unwrap();
            $scenario(&log, dir.path()).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $jetstream() {
            let server = NatsServer::start();
            let log = JetStreamLog::connect(&server.url(), JetStreamOptions::default())
                .await
                .unwrap();
            let dir = tempfile::tempdir().unwrap();
            $scenario(&log, dir.path()).await;
        }
    };
}

on_both_logs!(fences: fences_on_the_embedded_log, fences_on_jetstream);
on_both_logs!(race: two_schedulers_on_the_embedded_log, two_schedulers_on_jetstream);
