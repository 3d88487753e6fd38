//! Kill -9 the projector process at random points while events stream into a real nats-server:
//! after restarting, the projection's digest equals a full replay's, and every event was
//! counted exactly once.
//!
//! Seeded: each run prints its seed. `FAIRLEDGER_CRASH_RUNS` sets how many seeds run (20 by
//! default) and `FAIRLEDGER_CRASH_SEED` replays one.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use eventlog::testing::NatsServer;
use eventlog::{Append, EventLog, JetStreamLog, JetStreamOptions};
use rand::{RngExt, SeedableRng};

mod common;

use common::BIN;

/// Events streamed per run: a prefix of a simulated Alibaba ledger.
const EVENTS: usize = 4000;

fn ledger(dir: &Path) -> Vec<ledger::Envelope> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../sim");
    let status = Command::new(BIN)
        .args(["sim", "--format", "alibaba-openb", "--out"])
        .arg(dir)
        .arg("--scenario")
        .arg(root.join("scenarios/alibaba-32gpu.toml"))
        .arg("--workloads")
        .arg(root.join("traces/alibaba2023/openb_pod_list_default.csv"))
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    std::fs::read_to_string(dir.join("events.jsonl"))
        .unwrap()
        .lines()
        .take(EVENTS)
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn seeds() -> Vec<u64> {
    if let Ok(seed) = std::env::var("FAIRLEDGER_CRASH_SEED") {
        return vec![seed.parse().expect("FAIRLEDGER_CRASH_SEED is a number")];
    }
    let n: u64 = std::env::var("FAIRLEDGER_CRASH_RUNS")
        .ok()
        .map(|v| v.parse().expect("FAIRLEDGER_CRASH_RUNS is a number"))
        .unwrap_or(20);
    (1..=n).collect()
}

#[derive(serde::Deserialize, Debug)]
struct Reached {
    last_seq: u64,
    digest: String,
    applied: u64,
    rejected: u64,
    duplicates: u64,
    malformed: u64,
}

fn reached(args: &[&str], url: &str) -> Reached {
    common::json_of(&[args, &["--json", "--nats", url]].concat())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_projector_resumes_exactly_once() {
    let work = tempfile::tempdir().unwrap();
    let events = ledger(work.path());
    for seed in seeds() {
        eprintln!("projector kill -9 run, seed {seed} (FAIRLEDGER_CRASH_SEED={seed} replays it)");
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let server = NatsServer::start();
        let url = server.url();
        let log = JetStreamLog::connect(&url, JetStreamOptions::default())
            .await
            .unwrap();
        // Two malformed events at seeded places: they are skipped, counted, never wedge.
        let bad_at: Vec<usize> = (0..2).map(|_| rng.random_range(0..EVENTS)).collect();
        let chunks: Vec<usize> = (0..EVENTS).map(|_| rng.random_range(1..200)).collect();
        let publisher = {
            let log = log.clone();
            let events = events.clone();
            tokio::spawn(async move {
                let mut router = eventlog::subject::Router::default();
                let mut i = 0;
                let mut sizes = chunks.into_iter();
                while i < events.len() {
                    let n = sizes.next().unwrap().min(events.len() - i);
                    let mut batch: Vec<Append> = Vec::new();
                    for (j, e) in events[i..i + n].iter().enumerate() {
                        if bad_at.contains(&(i + j)) {
                            batch.push(
                                Append::new("fairledger.ledger.junk", "{\"type\":")
                                    .with_msg_id(format!("junk-{}", i + j)),
                            );
                        }
                        batch.push(router.append(e, None));
                    }
                    // As the error says: an unacknowledged batch is sent again with the same
                    // keys; refused as a duplicate, the first attempt went through.
                    let mut tries = 0;
                    loop {
                        match log.append_batch(batch.clone()).await {
                            Ok(_) | Err(eventlog::AppendError::DuplicateBatch(_)) => break,
                            Err(
                                e @ (eventlog::AppendError::Unacknowledged(_)
                                | eventlog::AppendError::Unavailable(_)),
                            ) if tries < 20 => {
                                tries += 1;
                                eprintln!("publishing again after: {e}");
                                tokio::time::sleep(Duration::from_millis(100)).await;
                            }
                            Err(e) => panic!("{e}"),
                        }
                    }
                    i += n;
                    tokio::time::sleep(Duration::from_millis(3)).await;
                }
            })
        };
        let projection: PathBuf = work.path().join(format!("projection-{seed}"));
        let mut resumed_from = Vec::new();
        for _ in 0..4 {
            let stderr = work.path().join("projector.err");
            let mut child = Command::new(BIN)
                .args(["project", "--nats", &url, "--projection"])
                .arg(&projection)
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&stderr).unwrap())
                .spawn()
                .unwrap();
            // Kill it at a seeded moment after it has started projecting.
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            while !std::fs::read_to_string(&stderr)
                .unwrap()
                .contains("projecting")
            {
                assert!(
                    std::time::Instant::now() < deadline,
                    "seed {seed}: the projector did not start"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            tokio::time::sleep(Duration::from_millis(rng.random_range(0..300))).await;
            child.kill().unwrap();
            child.wait().unwrap();
            let err = std::fs::read_to_string(&stderr).unwrap();
            assert!(
                !err.contains("rebuilding"),
                "seed {seed}: rebuilt instead of resuming:\n{err}"
            );
            if let Some(at) = err
                .split("from sequence ")
                .nth(1)
                .and_then(|r| r.split_whitespace().next())
            {
                resumed_from.push(at.parse::<u64>().unwrap());
            }
        }
        publisher.await.unwrap();
        let total = (EVENTS + 2) as u64;
        let incremental = reached(
            &[
                "project",
                "--once",
                "--projection",
                projection.to_str().unwrap(),
            ],
            &url,
        );
        let full = reached(&["replay"], &url);
        assert_eq!(incremental.last_seq, total, "seed {seed}");
        assert_eq!(full.last_seq, total, "seed {seed}");
        assert_eq!(
            incremental.digest, full.digest,
            "seed {seed}: the projection that survived kills differs from a full replay"
        );
        let counted = incremental.applied
            + incremental.rejected
            + incremental.duplicates
            + incremental.malformed;
        assert_eq!(counted, total, "seed {seed}: an event skipped or doubled");
        assert_eq!(incremental.malformed, 2, "seed {seed}");
        assert_eq!(
            (incremental.applied, incremental.rejected),
            (full.applied, full.rejected),
            "seed {seed}"
        );
        eprintln!("seed {seed}: restarts resumed from {resumed_from:?}");
    }
}
