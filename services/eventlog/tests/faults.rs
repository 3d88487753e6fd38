//! Faults: the log's promises hold when the server or the process dies mid-stream.
//!
//! - nats-server killed (SIGKILL) and restarted during a publish burst: every acknowledged
//!   append is in the stream exactly once; unacknowledged ones were reported as failures and
//!   their retries with the same idempotency key did not duplicate.
//! - The embedded log's process killed with SIGKILL mid-append: on reopening, the log holds
//!   every acknowledged event, and each writer's events form a prefix of what it attempted
//!   (half the runs without sled's background thread, as `serve` runs the log).
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
/// Set in the child: it opens the log without sled's background thread.
const CHILD_NO_COMPACTION: &str = "FAIRLEDGER_EVENTLOG_CHILD_NO_COMPACTION";

/// In the child process: append forever from several writers, printing each acknowledgement.
/// A subscription made before nats-server restarted ends as soon as the client is connected
/// again (its server-side reader may be gone), so its follower subscribes again at once instead
/// of waiting for its pulls to time out; the new subscription reads on where the old one was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_ends_when_the_connection_is_made_again() {
    use futures::StreamExt;
    let mut server = NatsServer::start();
    let log = JetStreamLog::connect(&server.url(), JetStreamOptions::default())
        .await
        .unwrap();
    log.append(key_append("before")).await.unwrap();
    let mut events = log.subscribe(1).await.unwrap();
    let first = events.next().await.unwrap().unwrap();
    assert_eq!(first.seq, 1);
    server.restart();
    let ended = tokio::time::timeout(Duration::from_secs(60), events.next())
        .await
        .expect("the old subscription never ended")
        .expect("an error, not the end of the stream");
    let why = ended.unwrap_err().to_string();
    assert!(why.contains("made again"), "{why}");
    // Appends and a fresh subscription work on the new connection.
    let mut acked = None;
    for _ in 0..100 {
        match log.append(key_append("after")).await {
            Ok(a) => {
                acked = Some(a);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    assert_eq!(acked.expect("appends resumed").seq, 2);
    let mut again = log.subscribe(2).await.unwrap();
    assert_eq!(again.next().await.unwrap().unwrap().seq, 2);
}

/// A follower of the feed (a process that may make no consumer: an agent, a reader) misses
/// nothing across a nats-server restart: what was published while it was away is read from the
/// stream when the next event shows the gap, or when the feed stays quiet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_of_the_feed_misses_nothing_across_a_restart() {
    use futures::StreamExt;
    let mut server = NatsServer::start();
    let service = JetStreamLog::connect(&server.url(), JetStreamOptions::default())
        .await
        .unwrap();
    service.append(key_append("before")).await.unwrap();
    let follower = JetStreamLog::connect(
        &server.url(),
        JetStreamOptions {
            manage_streams: false,
            ..JetStreamOptions::default()
        },
    )
    .await
    .unwrap();
    let mut events = follower.subscribe(1).await.unwrap();
    assert_eq!(events.next().await.unwrap().unwrap().seq, 1);
    server.restart();
    let mut acked = 0;
    for i in 0..200 {
        if acked == 5 {
            break;
        }
        match service.append(key_append(&format!("after-{acked}"))).await {
            Ok(_) => acked += 1,
            Err(_) if i < 199 => tokio::time::sleep(Duration::from_millis(100)).await,
            Err(e) => panic!("appends never resumed: {e}"),
        }
    }
    for seq in 2..=6 {
        let e = tokio::time::timeout(Duration::from_secs(60), events.next())
            .await
            .expect("the follower never caught up")
            .expect("the feed goes on")
            .unwrap();
        assert_eq!(e.seq, seq, "in order, without a gap");
    }
}

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
        if std::env::var_os(CHILD_NO_COMPACTION).is_some() {
            eventlog::embedded::set_background_compaction(false);
        }
        append_until_killed(&dir).await;
        return;
    }
    for seed in runs() {
        // Even seeds run the log as the server does, without sled's background thread: only
        // the log's own syncs make its acknowledgements durable.
        let compaction = seed % 2 == 1;
        eprintln!(
            "embedded kill -9 run, seed {seed}, background compaction {compaction} \
             (FAIRLEDGER_CRASH_SEED={seed} replays it)"
        );
        let dir = tempfile::tempdir().unwrap();
        // Kill after a seeded number of acknowledgements, 1 to 600.
        let kill_after = (seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 33) % 600 + 1;
        let mut child = Command::new(std::env::current_exe().unwrap());
        child
            .args([
                "--exact",
                "embedded_log_survives_kill_9_mid_append",
                "--nocapture",
            ])
            .env(CHILD_DIR, dir.path());
        if !compaction {
            child.env(CHILD_NO_COMPACTION, "1");
        }
        let mut child = child
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

const FULL_DISK_DIR: &str = "FAIRLEDGER_EVENTLOG_FULL_DISK_DIR";

/// In the child process, whose file size limit stands in for a full disk: append until the log
/// refuses, printing every acknowledgement and then the refusal.
async fn append_until_full(dir: &str) {
    let log = EmbeddedLog::open(std::path::Path::new(dir)).unwrap();
    for i in 0.. {
        let key = format!("w0-{i}");
        let body = format!("{key}:{}", "x".repeat(2000));
        let append = Append::new("fairledger.ledger.test.full", body).with_msg_id(&key);
        match log.append(append).await {
            Ok(ack) => println!("ack {key} {}", ack.seq),
            Err(e) => {
                println!("refused {e}");
                // Later appends are refused too, not half-written.
                let again = log.append(key_append("after")).await.unwrap_err();
                println!("refused {again}");
                return;
            }
        }
    }
}

#[test]
fn a_full_disk_fails_appends_clearly_and_loses_nothing_acknowledged() {
    if let Ok(dir) = std::env::var(FULL_DISK_DIR) {
        tokio::runtime::Runtime::new()
            .unwrap()
            .block_on(append_until_full(&dir));
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // A file size limit makes writes past 4 MiB fail with EFBIG, as a full disk fails them
    // with ENOSPC; SIGXFSZ is ignored so the write returns the error.
    let out = Command::new("sh")
        .arg("-c")
        .arg("ulimit -f 4096; trap '' XFSZ; exec \"$0\" \"$@\"")
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_full_disk_fails_appends_clearly_and_loses_nothing_acknowledged",
            "--nocapture",
        ])
        .env(FULL_DISK_DIR, dir.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let acked: Vec<(String, u64)> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("ack "))
        .map(|l| {
            let (k, s) = l.split_once(' ').unwrap();
            (k.to_owned(), s.parse().unwrap())
        })
        .collect();
    let refusals: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("refused "))
        .collect();
    assert_eq!(
        refusals.len(),
        2,
        "the child should hit the limit and report it:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        refusals[0].contains("not acknowledged") && refusals[0].contains("free disk space"),
        "{}",
        refusals[0]
    );
    assert!(
        refusals[1].contains("unavailable") && refusals[1].contains("free disk space"),
        "{}",
        refusals[1]
    );
    assert!(acked.len() > 100, "only {} acknowledged", acked.len());
    let log = EmbeddedLog::open(dir.path()).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let stored = rt.block_on(log.read(1, 1_000_000)).unwrap();
    for (key, seq) in &acked {
        let e = &stored[*seq as usize - 1];
        assert_eq!(
            e.msg_id.as_deref(),
            Some(key.as_str()),
            "acknowledged {key} lost"
        );
    }
    // With room again, the log goes on after what it holds.
    let next = rt.block_on(log.append(key_append("after"))).unwrap();
    assert_eq!(next.seq, stored.len() as u64 + 1);
}

#[tokio::test]
async fn a_damaged_embedded_log_is_refused_with_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    {
        let log = EmbeddedLog::open(dir.path()).unwrap();
        for i in 0..200 {
            log.append(key_append(&format!("k{i}"))).await.unwrap();
        }
    }
    // Overwrite the middle of every file sled keeps.
    let mut damaged = 0;
    for entry in walk(dir.path()) {
        if entry.ends_with("high-water") {
            continue;
        }
        let mut bytes = std::fs::read(&entry).unwrap();
        if bytes.len() < 64 {
            continue;
        }
        let mid = bytes.len() / 2;
        let end = (mid + 4096).min(bytes.len());
        bytes[mid..end].iter_mut().for_each(|b| *b = 0xA5);
        std::fs::write(&entry, bytes).unwrap();
        damaged += 1;
    }
    assert!(damaged > 0);
    let opened = std::panic::catch_unwind(|| EmbeddedLog::open(dir.path()));
    let err = match opened {
        Ok(Ok(log)) => {
            // sled may recover a prefix; then reading must not return garbage silently.
            let read = log.read(1, 1000).await;
            match read {
                Ok(events) => {
                    // Only an intact log may open: every event there, each as written.
                    assert_eq!(events.len(), 200, "a shortened log opened silently");
                    for e in &events {
                        assert_eq!(e.payload, format!("k{}", e.seq - 1), "garbage served");
                    }
                    return;
                }
                Err(e) => e.to_string(),
            }
        }
        Ok(Err(e)) => e.to_string(),
        Err(_) => panic!("opening a damaged log panicked instead of reporting it"),
    };
    eprintln!("damaged log: {err}");
    assert!(err.contains("corrupt") || err.contains("restore"), "{err}");
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else {
            out.push(path);
        }
    }
    out
}
