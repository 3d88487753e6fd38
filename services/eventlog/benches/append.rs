//! Append throughput of the event log: JetStream on loopback (pipelined single appends, atomic
//! batches, and with `sync_interval: always` with and without group commit) and the embedded
//! sled log. A nats-server is started for each JetStream case.
//!
//! `cargo bench -p eventlog --bench append` (`FAIRLEDGER_BENCH_APPENDS=N` sets the events per
//! case, 100,000 by default). Prints one line per case.

use std::time::Instant;

use bytes::Bytes;
use eventlog::testing::{NatsServer, ServerOptions};
use eventlog::{Append, EmbeddedLog, EventLog, JetStreamLog, JetStreamOptions};
use futures::StreamExt;

/// A payload the size of a typical ledger event (a start with a placement, ~300 bytes).
fn payload(i: usize) -> Bytes {
    Bytes::from(format!(
        "{{\"id\":\"0190c4c2-7b7e-7d4e-9e4b-{i:012}\",\"schema_version\":1,\"occurred_at_ms\":{i},\"actor\":\"scheduler\",\"type\":\"workload_started\",\"payload\":{{\"workload\":\"0190c4c2-7b7e-7d4e-9e4b-{i:012}\",\"placement\":[{{\"node\":\"node-0042\",\"gpus\":[0,1,2,3,4,5,6,7]}}],\"protected_until_ms\":{}}}}}",
        i + 7_200_000
    ))
}

fn append(i: usize) -> Append {
    Append::new("fairledger.ledger.workload.started.ai2.olmo", payload(i))
        .with_msg_id(format!("k{i}"))
}

/// Keys of each case start here, so no case repeats another's idempotency keys.
static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn keys(n: usize) -> std::ops::Range<usize> {
    let first = NEXT.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    first..first + n
}

async fn singles<L: EventLog + Clone>(log: &L, n: usize, concurrency: usize) -> f64 {
    let started = Instant::now();
    futures::stream::iter(keys(n))
        .map(|i| {
            let log = log.clone();
            async move { log.append(append(i)).await.unwrap() }
        })
        .buffer_unordered(concurrency)
        .for_each(|_| async {})
        .await;
    n as f64 / started.elapsed().as_secs_f64()
}

async fn batches<L: EventLog + Clone>(log: &L, n: usize, size: usize, concurrency: usize) -> f64 {
    let started = Instant::now();
    let range = keys(n);
    let end = range.end;
    futures::stream::iter(range.step_by(size))
        .map(|first| {
            let log = log.clone();
            async move {
                let batch = (first..(first + size).min(end)).map(append).collect();
                log.append_batch(batch).await.unwrap()
            }
        })
        .buffer_unordered(concurrency)
        .for_each(|_| async {})
        .await;
    n as f64 / started.elapsed().as_secs_f64()
}

fn report(case: &str, per_s: f64) {
    println!("{case:<58} {per_s:>10.0} appends/s");
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n: usize = std::env::var("FAIRLEDGER_BENCH_APPENDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    println!("{n} appends of ~{} bytes per case", payload(0).len());
    for (sync_always, group_commit) in [(false, false), (true, false), (true, true)] {
        let server = NatsServer::start_with(ServerOptions {
            sync_always,
            ..Default::default()
        });
        let options = JetStreamOptions {
            group_commit,
            ..Default::default()
        };
        let log = JetStreamLog::connect(&server.url(), options).await.unwrap();
        let mode = match (sync_always, group_commit) {
            (false, _) => "jetstream, default fsync",
            (true, false) => "jetstream, sync_interval: always",
            (true, true) => "jetstream, sync_interval: always, group commit",
        };
        report(&format!("{mode}, 1 writer"), singles(&log, n / 10, 1).await);
        report(
            &format!("{mode}, 512 concurrent"),
            singles(&log, n, 512).await,
        );
        if !group_commit {
            report(
                &format!("{mode}, atomic batches of 1000"),
                batches(&log, n, 1000, 8).await,
            );
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let log = EmbeddedLog::open(dir.path()).unwrap();
    report("embedded sled, 1 writer", singles(&log, n / 100, 1).await);
    report("embedded sled, 512 concurrent", singles(&log, n, 512).await);
    report(
        "embedded sled, atomic batches of 1000",
        batches(&log, n, 1000, 8).await,
    );
}
