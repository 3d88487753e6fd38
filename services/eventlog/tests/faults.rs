//! Faults: the log's promises hold when the server or the process dies mid-stream.
//!
//! - nats-server killed (SIGKILL) and restarted during a publish burst: every acknowledged
//!   append is in the stream exactly once; unacknowledged ones were reported as failures and
//!   their retries with the same idempotency key did not duplicate.
//! - The embedded log's process killed with SIGKILL mid-append: on reopening, the log holds
//!   every acknowledged event, and each writer's events form a prefix of what it attempted.
//!
//! Randomized runs print their seed; `FAIRLEDGER_CRASH_RUNS` sets how many seeds run and
//! `FAIRLEDGER_CRASH_SEED` replays one.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use eventlog::testing::{NatsServer, ServerOptions};
use eventlog::{Append, AppendError, EmbeddedLog, EventLog, JetStreamLog, JetStreamOptions};

fn key_append(key: &str) -> Append {
    Append::new(format!("fairledger.ledger.test.{key}"), key.to_owned()).with_msg_id(key)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_restart_mid_burst_loses_and_doubles_nothing() {
    let mut server = NatsServer::start_with(ServerOptions {
        sync_always: true,
        ..Default::default()
    });
    let options = JetStreamOptions {
        ack_timeout: Duration::from_millis(500),
        ..Default::default()
    };
    let log = JetStreamLog::connect(&server.url(), options).await.unwrap();
    let writers = 8;
    let per_writer = 250;
    let acked = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..writers)
        .map(|w| {
            let log = log.clone();
            let acked = acked.clone();
            tokio::spawn(async move {
                let mut acks = Vec::new();
                let mut failures = 0;
                for i in 0..per_writer {
                    let key = format!("w{w}-{i}");
                    loop {
                        match log.append(key_append(&key)).await {
                            Ok(ack) => {
                                acks.push((key, ack.seq));
                                acked.fetch_add(1, Ordering::Relaxed);
                                break;
                            }
                            Err(AppendError::Unacknowledged(_) | AppendError::Unavailable(_)) => {
                                failures += 1;
                                tokio::time::sleep(Duration::from_millis(50)).await;
                            }
                            Err(e) => panic!("unexpected answer for {key}: {e}"),
                        }
                    }
                }
                (acks, failures)
            })
        })
        .collect();
    while acked.load(Ordering::Relaxed) < writers * per_writer / 4 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    server.kill();
    tokio::time::sleep(Duration::from_millis(700)).await;
    server.restart();
    let mut acked_at = HashMap::new();
    let mut failures = 0;
    for t in tasks {
        let (acks, f) = t.await.unwrap();
        failures += f;
        for (key, seq) in acks {
            assert!(acked_at.insert(key, seq).is_none());
        }
    }
    assert!(failures > 0, "the kill should have failed some appends");
    let stored = log.read(1, 1_000_000).await.unwrap();
    let mut seen = HashMap::new();
    for e in &stored {
        let key = String::from_utf8(e.payload.to_vec()).unwrap();
        assert!(
            seen.insert(key.clone(), e.seq).is_none(),
            "{key} is in the stream twice"
        );
    }
    assert_eq!(
        seen.len(),
        writers * per_writer,
        "every append is there once"
    );
    for (key, seq) in &acked_at {
        assert_eq!(
            seen.get(key),
            Some(seq),
            "acknowledged {key} moved or vanished"
        );
    }
}

const CHILD_DIR: &str = "FAIRLEDGER_EVENTLOG_CHILD_DIR";

/// In the child process: append forever from several writers, printing each acknowledgement.
async fn append_until_killed(dir: &str) {
    let log = EmbeddedLog::open(std::path::Path::new(dir)).unwrap();
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let log = log.clone();
            tokio::spawn(async move {
                for i in 0.. {
                    let key = format!("w{w}-{i}");
                    let ack = log.append(key_append(&key)).await.unwrap();
                    println!("ack {key} {}", ack.seq);
                }
            })
        })
        .collect();
    for w in writers {
        w.await.unwrap();
    }
}

fn runs() -> Vec<u64> {
    if let Ok(seed) = std::env::var("FAIRLEDGER_CRASH_SEED") {
        return vec![seed.parse().expect("FAIRLEDGER_CRASH_SEED is a number")];
    }
    let n: u64 = std::env::var("FAIRLEDGER_CRASH_RUNS")
        .ok()
        .map(|v| v.parse().expect("FAIRLEDGER_CRASH_RUNS is a number"))
        .unwrap_or(5);
    (1..=n).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_log_survives_kill_9_mid_append() {
    if let Ok(dir) = std::env::var(CHILD_DIR) {
        append_until_killed(&dir).await;
        return;
    }
    for seed in runs() {
        eprintln!("embedded kill -9 run, seed {seed} (FAIRLEDGER_CRASH_SEED={seed} replays it)");
        let dir = tempfile::tempdir().unwrap();
        // Kill after a seeded number of acknowledgements, 1 to 600.
        let kill_after = (seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 33) % 600 + 1;
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "embedded_log_survives_kill_9_mid_append",
                "--nocapture",
            ])
            .env(CHILD_DIR, dir.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut acked = BTreeMap::new();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        for line in stdout.lines() {
            let line = line.unwrap();
            let mut parts = line.split_whitespace();
            if parts.next() != Some("ack") {
                continue;
            }
            let key = parts.next().unwrap().to_owned();
            let seq: u64 = parts.next().unwrap().parse().unwrap();
            acked.insert(key, seq);
            if acked.len() as u64 >= kill_after {
                child.kill().unwrap();
                break;
            }
        }
        child.wait().unwrap();
        assert!(
            acked.len() as u64 >= kill_after,
            "seed {seed}: the child died early"
        );

        let log = EmbeddedLog::open(dir.path()).unwrap();
        let stored = log.read(1, 10_000_000).await.unwrap();
        let mut per_writer: BTreeMap<String, Vec<u64>> = BTreeMap::new();
        let mut at = HashMap::new();
        for (i, e) in stored.iter().enumerate() {
            assert_eq!(e.seq, i as u64 + 1, "seed {seed}: sequences have a hole");
            let key = String::from_utf8(e.payload.to_vec()).unwrap();
            assert_eq!(e.msg_id.as_deref(), Some(key.as_str()));
            let (writer, n) = key.split_once('-').unwrap();
            per_writer
                .entry(writer.to_owned())
                .or_default()
                .push(n.parse().unwrap());
            assert!(
                at.insert(key, e.seq).is_none(),
                "seed {seed}: an event twice"
            );
        }
        for (writer, ns) in &per_writer {
            let prefix: Vec<u64> = (0..ns.len() as u64).collect();
            assert_eq!(
                ns, &prefix,
                "seed {seed}: {writer}'s events are not a prefix"
            );
        }
        for (key, seq) in &acked {
            assert_eq!(
                at.get(key),
                Some(seq),
                "seed {seed}: acknowledged {key} was lost"
            );
        }
        // The reopened log goes on where it stopped.
        let next = log.append(key_append("after")).await.unwrap();
        assert_eq!(next.seq, stored.len() as u64 + 1);
    }
}
