//! Projector throughput and restart time at a million events.
//!
//! Builds a ledger of about a million events by tiling the simulated Alibaba ledger (workload
//! events repeated with fresh ids after the previous copy drained), writes it to an embedded
//! log and, when `NATS_SERVER_BIN` or `nats-server` is available, to JetStream, then measures a
//! full replay into a fresh sled projection, and the restart of a projection with and without a
//! recent checkpoint.
//!
//! `cargo bench -p projector --bench replay` (`FAIRLEDGER_BENCH_EVENTS=N`, default 1,000,000).

use std::time::Instant;

use eventlog::testing::NatsServer;
use eventlog::{EmbeddedLog, EventLog, JetStreamLog, JetStreamOptions};
use ledger::{Envelope, Event, StateConfig};
use projector::Projector;

fn alibaba() -> Vec<Envelope> {
    let out = tempfile::tempdir().unwrap();
    let spec = sim::bundled_alibaba(out.path(), Some("fairshare")).unwrap();
    sim::run(&spec, |_| {}).unwrap();
    sim::read_ledger(&out.path().join("events.jsonl")).unwrap()
}

fn remap(value: &mut serde_json::Value, copy: u128) {
    match value {
        serde_json::Value::String(s) => {
            if let Ok(id) = uuid::Uuid::parse_str(s) {
                *s = uuid::Uuid::from_u128(id.as_u128() ^ (copy << 64)).to_string();
            }
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(|v| remap(v, copy)),
        serde_json::Value::Object(map) => map.values_mut().for_each(|v| remap(v, copy)),
        _ => {}
    }
}

/// About `n` events: the ledger, then its workload events again with fresh ids, each copy
/// after the previous one has drained.
fn tiled(base: &[Envelope], n: usize) -> Vec<Envelope> {
    let span = base.last().unwrap().occurred_at_ms + 3_600_000;
    let mut out: Vec<Envelope> = base.to_vec();
    let workload_events: Vec<&Envelope> = base
        .iter()
        .filter(|e| e.event.workload().is_some())
        .collect();
    let mut copy = 1u128;
    while out.len() < n {
        for e in &workload_events {
            if out.len() >= n {
                break;
            }
            let mut v = serde_json::to_value(e).unwrap();
            remap(&mut v, copy);
            let mut e: Envelope = serde_json::from_value(v).unwrap();
            e.occurred_at_ms += span * copy as u64;
            if let Event::WorkloadStarted(s) = &mut e.event {
                s.protected_until_ms += span * copy as u64;
            }
            out.push(e);
        }
        copy += 1;
    }
    out
}

async fn fill<L: EventLog>(log: &L, events: &[Envelope]) -> f64 {
    let started = Instant::now();
    let mut router = eventlog::subject::Router::default();
    for chunk in events.chunks(1000) {
        let appends = chunk.iter().map(|e| router.append(e, None)).collect();
        log.append_batch(appends).await.unwrap();
    }
    started.elapsed().as_secs_f64()
}

async fn measure<L: EventLog>(name: &str, log: &L, events: usize) {
    let dir = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let (_, stats, last) = projector::replay(log, &dir.path().join("full"), StateConfig::default())
        .await
        .unwrap();
    let replay_s = started.elapsed().as_secs_f64();
    assert_eq!(last as usize, events);
    println!(
        "{name}: full replay of {last} events into sled: {replay_s:.2} s ({:.0} events/s; {} applied, {} rejected)",
        last as f64 / replay_s,
        stats.applied,
        stats.rejected
    );
    // Restart with a checkpoint at the end.
    {
        let mut p = Projector::open(&dir.path().join("full"), StateConfig::default(), log)
            .await
            .unwrap();
        p.checkpoint().unwrap();
    }
    let started = Instant::now();
    let p = Projector::open(&dir.path().join("full"), StateConfig::default(), log)
        .await
        .unwrap();
    assert_eq!(p.last_seq(), last);
    println!(
        "{name}: restart with a checkpoint at the last event: {:.2} s",
        started.elapsed().as_secs_f64()
    );
    drop(p);
    // Restart with no checkpoint: the state is refolded from the log.
    {
        let mut p = Projector::open(&dir.path().join("bare"), StateConfig::default(), log)
            .await
            .unwrap()
            .checkpoint_every(u64::MAX);
        p.catch_up(log).await.unwrap();
    }
    let started = Instant::now();
    let p = Projector::open(&dir.path().join("bare"), StateConfig::default(), log)
        .await
        .unwrap();
    assert_eq!(p.state().last_seq(), last);
    println!(
        "{name}: restart without a checkpoint (refold of the whole log): {:.2} s",
        started.elapsed().as_secs_f64()
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n: usize = std::env::var("FAIRLEDGER_BENCH_EVENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let events = tiled(&alibaba(), n);
    println!("{} events", events.len());

    // Where the time of a replay goes: decoding, then folding, without any storage.
    let encoded: Vec<Vec<u8>> = events
        .iter()
        .map(|e| serde_json::to_vec(e).unwrap())
        .collect();
    let started = Instant::now();
    let decoded: Vec<Envelope> = encoded
        .iter()
        .map(|b| projector::decode(b).unwrap())
        .collect();
    let decode_s = started.elapsed().as_secs_f64();
    let started = Instant::now();
    let mut state = ledger::State::new(StateConfig::default());
    for (i, e) in decoded.iter().enumerate() {
        state.apply(i as u64 + 1, e);
    }
    let fold_s = started.elapsed().as_secs_f64();
    println!(
        "in memory: decode {:.0} events/s, fold {:.0} events/s",
        events.len() as f64 / decode_s,
        events.len() as f64 / fold_s
    );

    let dir = tempfile::tempdir().unwrap();
    let log = EmbeddedLog::open(dir.path()).unwrap();
    let fill_s = fill(&log, &events).await;
    println!(
        "embedded: appended in batches of 1000 in {fill_s:.2} s ({:.0} events/s)",
        events.len() as f64 / fill_s
    );
    measure("embedded", &log, events.len()).await;
    drop(log);

    let server = NatsServer::start();
    let log = JetStreamLog::connect(&server.url(), JetStreamOptions::default())
        .await
        .unwrap();
    let fill_s = fill(&log, &events).await;
    println!(
        "jetstream: appended in atomic batches of 1000 in {fill_s:.2} s ({:.0} events/s)",
        events.len() as f64 / fill_s
    );
    measure("jetstream", &log, events.len()).await;
}
