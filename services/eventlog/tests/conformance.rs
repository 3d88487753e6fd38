//! The conformance suite of the event log: every case runs against the embedded sled log, the
//! JetStream log on a real nats-server, and the JetStream log with group commit.

use std::collections::BTreeSet;

use bytes::Bytes;
use eventlog::testing::NatsServer;
use eventlog::{
    Append, AppendError, EmbeddedLog, EventLog, Expect, JetStreamLog, JetStreamOptions,
};
use futures::StreamExt;

fn subject(tail: &str) -> String {
    format!("fairledger.ledger.test.{tail}")
}

fn append(tail: &str, body: &str) -> Append {
    Append::new(subject(tail), Bytes::from(body.to_owned()))
}

async fn payloads<L: EventLog>(log: &L) -> Vec<String> {
    log.read(1, 100_000)
        .await
        .unwrap()
        .into_iter()
        .map(|e| String::from_utf8(e.payload.to_vec()).unwrap())
        .collect()
}

async fn sequences_increase_and_read_back<L: EventLog>(log: &L) {
    assert_eq!(log.last_seq().await.unwrap(), 0);
    assert!(log.read(1, 10).await.unwrap().is_empty());
    for i in 1..=5u64 {
        let ack = log.append(append("a", &format!("e{i}"))).await.unwrap();
        assert_eq!((ack.seq, ack.duplicate), (i, false));
    }
    assert_eq!(log.last_seq().await.unwrap(), 5);
    let mid = log.read(3, 2).await.unwrap();
    assert_eq!(mid.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![3, 4]);
    assert_eq!(mid[0].payload, Bytes::from("e3"));
    assert_eq!(mid[0].subject, subject("a"));
    assert!(log.read(6, 10).await.unwrap().is_empty());
    assert_eq!(
        log.read(0, 100).await.unwrap().len(),
        5,
        "0 reads from the start"
    );
}

async fn an_idempotency_key_is_written_once<L: EventLog>(log: &L) {
    let first = log
        .append(append("a", "one").with_msg_id("key-1"))
        .await
        .unwrap();
    log.append(append("a", "other")).await.unwrap();
    let again = log
        .append(append("a", "one again").with_msg_id("key-1"))
        .await
        .unwrap();
    assert!(!first.duplicate);
    assert!(again.duplicate);
    assert_eq!(
        again.seq, first.seq,
        "a duplicate answers with the original"
    );
    assert_eq!(payloads(log).await, vec!["one", "other"]);
    let stored = log.read(1, 1).await.unwrap();
    assert_eq!(stored[0].msg_id.as_deref(), Some("key-1"));
}

async fn a_stale_writer_gets_a_conflict<L: EventLog>(log: &L) {
    log.append(append("a", "1")).await.unwrap();
    log.append(append("a", "2")).await.unwrap();
    let stale = log
        .append(append("a", "stale").expecting(Expect::LastSequence(1)))
        .await
        .unwrap_err();
    assert_eq!(
        stale,
        AppendError::Conflict {
            expected: 1,
            actual: 2
        }
    );
    let fresh = log
        .append(append("a", "fresh").expecting(Expect::LastSequence(2)))
        .await
        .unwrap();
    assert_eq!(fresh.seq, 3);
    assert_eq!(payloads(log).await, vec!["1", "2", "fresh"]);
}

async fn subject_sequences_guard_one_subject_or_a_filter<L: EventLog>(log: &L) {
    log.append(append("x.one", "1")).await.unwrap();
    log.append(append("y.one", "2")).await.unwrap();
    log.append(append("x.two", "3")).await.unwrap();
    let on = |filter: &str, seq| Expect::LastSubjectSequence {
        filter: filter.to_owned(),
        seq,
    };
    // Exact subject.
    let err = log
        .append(append("x.one", "no").expecting(on(&subject("x.one"), 0)))
        .await
        .unwrap_err();
    assert!(
        matches!(err, AppendError::Conflict { expected: 0, .. }),
        "{err:?}"
    );
    let ok = log
        .append(append("x.one", "4").expecting(on(&subject("x.one"), 1)))
        .await
        .unwrap();
    assert_eq!(ok.seq, 4);
    // A wildcard filter over the x subjects: the last of them is now 4.
    let err = log
        .append(append("x.three", "no").expecting(on(&subject("x.>"), 3)))
        .await
        .unwrap_err();
    assert!(
        matches!(err, AppendError::Conflict { expected: 3, .. }),
        "{err:?}"
    );
    log.append(append("x.three", "5").expecting(on(&subject("x.>"), 4)))
        .await
        .unwrap();
    // A subject never written to has last sequence 0.
    log.append(append("z", "6").expecting(on(&subject("z"), 0)))
        .await
        .unwrap();
    assert_eq!(payloads(log).await, vec!["1", "2", "3", "4", "5", "6"]);
}

async fn batches_are_all_or_nothing<L: EventLog>(log: &L) {
    log.append(append("a", "0").with_msg_id("k0"))
        .await
        .unwrap();
    let acks = log
        .append_batch(vec![
            append("a", "1").with_msg_id("k1"),
            append("b", "2"),
            append("a", "3").with_msg_id("k3"),
        ])
        .await
        .unwrap();
    assert_eq!(
        acks.iter().map(|a| a.seq).collect::<Vec<_>>(),
        vec![2, 3, 4]
    );
    // A wrong expectation on the first event: nothing of the batch is written.
    let err = log
        .append_batch(vec![
            append("a", "no").expecting(Expect::LastSequence(3)),
            append("a", "no"),
        ])
        .await
        .unwrap_err();
    assert!(
        matches!(err, AppendError::Conflict { expected: 3, .. }),
        "{err:?}"
    );
    // A known key inside: refused whole.
    let err = log
        .append_batch(vec![append("a", "no"), append("a", "no").with_msg_id("k1")])
        .await
        .unwrap_err();
    assert!(matches!(err, AppendError::DuplicateBatch(_)), "{err:?}");
    // A key twice in one batch: refused whole.
    let err = log
        .append_batch(vec![
            append("a", "no").with_msg_id("k9"),
            append("a", "no").with_msg_id("k9"),
        ])
        .await
        .unwrap_err();
    assert!(matches!(err, AppendError::DuplicateBatch(_)), "{err:?}");
    // Too big, or empty.
    let big = (0..=eventlog::MAX_BATCH)
        .map(|_| append("a", "no"))
        .collect();
    assert!(matches!(
        log.append_batch(big).await.unwrap_err(),
        AppendError::Refused(_)
    ));
    assert!(matches!(
        log.append_batch(Vec::new()).await.unwrap_err(),
        AppendError::Refused(_)
    ));
    // Right expectation on the first event.
    let acks = log
        .append_batch(vec![
            append("a", "5").expecting(Expect::LastSequence(4)),
            append("a", "6"),
        ])
        .await
        .unwrap();
    assert_eq!(acks.iter().map(|a| a.seq).collect::<Vec<_>>(), vec![5, 6]);
    assert_eq!(payloads(log).await, vec!["0", "1", "2", "3", "5", "6"]);
}

async fn bad_subjects_are_refused_and_change_nothing<L: EventLog>(log: &L) {
    for bad in [
        "elsewhere.x",
        "fairledger.ledger",
        "fairledger.ledger.a..b",
        "fairledger.ledger.*",
        "fairledger.ledger.a b",
    ] {
        let err = log.append(Append::new(bad, "x")).await.unwrap_err();
        assert!(matches!(err, AppendError::Refused(_)), "{bad}: {err:?}");
    }
    assert_eq!(log.last_seq().await.unwrap(), 0);
}

async fn subscriptions_replay_then_tail<L: EventLog>(log: &L) {
    for i in 1..=3 {
        log.append(append("a", &i.to_string())).await.unwrap();
    }
    let mut sub = log.subscribe(2).await.unwrap();
    let mut seen = Vec::new();
    for _ in 0..2 {
        seen.push(sub.next().await.unwrap().unwrap().seq);
    }
    assert_eq!(seen, vec![2, 3]);
    let writer = async {
        for i in 4..=6 {
            log.append(append("a", &i.to_string())).await.unwrap();
        }
    };
    let reader = async {
        let mut tail = Vec::new();
        while tail.len() < 3 {
            let e = sub.next().await.unwrap().unwrap();
            tail.push((e.seq, String::from_utf8(e.payload.to_vec()).unwrap()));
        }
        tail
    };
    let ((), tail) = tokio::join!(writer, reader);
    assert_eq!(
        tail,
        vec![(4, "4".into()), (5, "5".into()), (6, "6".into())]
    );
}

async fn concurrent_appends_each_get_one_sequence<L: EventLog + Clone>(log: &L) {
    let n = 300;
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let log = log.clone();
            tokio::spawn(async move {
                let ack = log
                    .append(append("c", &format!("p{i}")).with_msg_id(format!("c{i}")))
                    .await
                    .unwrap();
                (i, ack.seq)
            })
        })
        .collect();
    let mut by_seq = std::collections::BTreeMap::new();
    for t in tasks {
        let (i, seq) = t.await.unwrap();
        assert!(
            by_seq.insert(seq, i).is_none(),
            "sequence {seq} given twice"
        );
    }
    assert_eq!(
        by_seq.keys().copied().collect::<BTreeSet<_>>(),
        (1..=n as u64).collect::<BTreeSet<_>>()
    );
    for e in log.read(1, n).await.unwrap() {
        assert_eq!(e.payload, Bytes::from(format!("p{}", by_seq[&e.seq])));
    }
}

struct Embedded {
    _dir: tempfile::TempDir,
    log: EmbeddedLog,
}

async fn point_reads_answer_their_event<L: EventLog>(log: &L) {
    for i in 1..=20u64 {
        log.append(append("p", &format!("e{i}")).with_msg_id(format!("k{i}")))
            .await
            .unwrap();
    }
    for round in 0..30u64 {
        let seq = 1 + round % 20;
        let got = log.read(seq, 1).await.unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].seq, seq);
        assert_eq!(got[0].payload, Bytes::from(format!("e{seq}")));
        assert_eq!(got[0].msg_id.as_deref(), Some(format!("k{seq}").as_str()));
        assert_eq!(got[0].subject, subject("p"));
    }
    let few = log.read(18, 16).await.unwrap();
    assert_eq!(few.iter().map(|e| e.seq).collect::<Vec<_>>(), [18, 19, 20]);
}

/// Reads, from one event to pages longer than one answer of the server, leave no reader behind
/// on it, so no number of them can use up its consumers; a long page comes back whole and in
/// order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_on_nats_open_no_readers() {
    let f = on_nats(false).await;
    point_reads_answer_their_event(&f.log).await;
    for chunk in 0..3 {
        let batch = (0..1000)
            .map(|i| append("p", &format!("bulk {chunk} {i}")))
            .collect();
        f.log.append_batch(batch).await.unwrap();
    }
    let page = f.log.read(7, 5_000).await.unwrap();
    assert_eq!(
        page.iter().map(|e| e.seq).collect::<Vec<_>>(),
        (7..=3_020).collect::<Vec<_>>()
    );
    assert_eq!(page[3_020 - 7].payload, Bytes::from("bulk 2 999"));
    assert_eq!(f.log.readers_open().await.unwrap(), 0);
}

fn embedded() -> Embedded {
    let dir = tempfile::tempdir().unwrap();
    let log = EmbeddedLog::open(dir.path()).unwrap();
    Embedded { _dir: dir, log }
}

struct OnNats {
    _server: NatsServer,
    log: JetStreamLog,
}

async fn on_nats(group_commit: bool) -> OnNats {
    let server = NatsServer::start();
    let options = JetStreamOptions {
        group_commit,
        ..Default::default()
    };
    let log = JetStreamLog::connect(&server.url(), options).await.unwrap();
    OnNats {
        _server: server,
        log,
    }
}

macro_rules! conformance {
    ($($case:ident),* $(,)?) => {
        mod embedded {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let f = super::embedded();
                    super::$case(&f.log).await;
                }
            )*
        }
        mod jetstream {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let f = super::on_nats(false).await;
                    super::$case(&f.log).await;
                }
            )*
        }
        mod jetstream_group_commit {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let f = super::on_nats(true).await;
                    super::$case(&f.log).await;
                }
            )*
        }
    };
}

conformance!(
    sequences_increase_and_read_back,
    point_reads_answer_their_event,
    an_idempotency_key_is_written_once,
    a_stale_writer_gets_a_conflict,
    subject_sequences_guard_one_subject_or_a_filter,
    batches_are_all_or_nothing,
    bad_subjects_are_refused_and_change_nothing,
    subscriptions_replay_then_tail,
    concurrent_appends_each_get_one_sequence,
);
