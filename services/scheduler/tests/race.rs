//! Two schedulers deciding on the same log can never both place from stale state: the second
//! to append finds the log moved and gets a conflict, on the embedded log and on JetStream.

use eventlog::testing::NatsServer;
use eventlog::{Append, EmbeddedLog, EventLog, JetStreamLog, JetStreamOptions};
use ledger::event::*;
use ledger::{Envelope, StateConfig};
use projector::Projector;
use scheduler::{step, SchedulerConfig};
use tokio::sync::RwLock;
use uuid::Uuid;

async fn setup<L: EventLog>(log: &L) {
    let mut events = Vec::new();
    for n in 0..2 {
        events.push(Event::NodeRegistered(NodeRegistered {
            node: format!("n{n}"),
            gpus: 8,
            model: "H100".into(),
            labels: Default::default(),
        }));
    }
    events.push(Event::AllocationSet(AllocationSet {
        path: "team".into(),
        weight: 1,
        max_gpus: None,
    }));
    for i in 0..12u64 {
        events.push(Event::WorkloadSubmitted(WorkloadSubmitted::new(
            Uuid::from_u64_pair(7, i),
            Some("team".into()),
            [1, 2, 4][i as usize % 3],
            1,
        )));
    }
    let appends: Vec<Append> = events
        .into_iter()
        .map(|e| {
            Append::event(
                &Envelope::new(Uuid::now_v7(), 1_000, "test", e),
                Some("team"),
                None,
            )
        })
        .collect();
    log.append_batch(appends).await.unwrap();
}

async fn race<L: EventLog>(log: &L, dir: &std::path::Path) {
    setup(log).await;
    let config = SchedulerConfig::default();
    let open = |name: &'static str| async move {
        let mut p = Projector::open(&dir.join(name), StateConfig::default(), log)
            .await
            .unwrap();
        p.catch_up(log).await.unwrap();
        RwLock::new(p)
    };
    let (a, b) = (open("a").await, open("b").await);
    let mut conflicts = 0;
    let mut appended = 0;
    for round in 0..10u64 {
        let now = 2_000 + round * 1_000;
        // Both decide on the same state; only the first append may land.
        let first = step(log, &a, &config, now).await.unwrap();
        let second = step(log, &b, &config, now).await.unwrap();
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
    assert_eq!(held, p.state().cluster.allocated_gpus);
    assert!((14..=16).contains(&held), "{held} GPUs held");
    assert_eq!(b.read().await.digest().unwrap(), p.digest().unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_schedulers_on_the_embedded_log() {
    let dir = tempfile::tempdir().unwrap();
    let log = EmbeddedLog::open(&dir.path().join("log")).unwrap();
    race(&log, dir.path()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_schedulers_on_jetstream() {
    let server = NatsServer::start();
    let log = JetStreamLog::connect(&server.url(), JetStreamOptions::default())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    race(&log, dir.path()).await;
}
