//! The output store's conformance: every case runs against the embedded store (in the sled log's
//! database) and the `OUTPUT` stream on a real nats-server.

use std::time::Duration;

use bytes::Bytes;
use eventlog::output::{Chunk, OutputLimits, OutputStore, RunKey, Shipped};
use eventlog::testing::NatsServer;
use eventlog::{EmbeddedLog, JetStreamLog, JetStreamOptions};
use uuid::Uuid;

fn key(run: u64, node: &str) -> RunKey {
    RunKey {
        workload: Uuid::from_u128(0x1234),
        run,
        node: node.to_owned(),
    }
}

fn chunk(offset: u64, data: &str, end: bool) -> Chunk {
    Chunk {
        offset,
        data: Bytes::from(data.to_owned()),
        end,
        at_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64,
    }
}

/// Everything kept of `key`, read a page of at most `page` bytes at a time: (first offset, the
/// bytes put together, whether the end was read).
async fn all<S: OutputStore>(store: &S, key: &RunKey, page: usize) -> (u64, String, bool) {
    let mut cursor = 0;
    let mut first = None;
    let mut text = String::new();
    let mut ended = false;
    let mut at = 0;
    loop {
        let p = store.read(key, cursor, page).await.unwrap();
        if p.chunks.is_empty() {
            break;
        }
        for c in p.chunks {
            first.get_or_insert(c.offset);
            if c.offset + c.data.len() as u64 <= at && at > 0 {
                continue;
            }
            let skip = at.saturating_sub(c.offset) as usize;
            text += std::str::from_utf8(&c.data[skip.min(c.data.len())..]).unwrap();
            at = c.offset + c.data.len() as u64;
            ended |= c.end;
        }
        cursor = p.cursor;
    }
    (first.unwrap_or(0), text, ended)
}

async fn output_reads_back_in_order_and_says_where_it_stands<S: OutputStore>(store: &S) {
    let k = key(1, "node-a");
    assert_eq!(store.shipped(&k).await.unwrap(), None);
    store.append(&k, chunk(0, "hello ", false)).await.unwrap();
    store.append(&k, chunk(6, "world\n", false)).await.unwrap();
    assert_eq!(
        store.shipped(&k).await.unwrap(),
        Some(Shipped {
            next_offset: 12,
            ended: false
        })
    );
    store.append(&k, chunk(12, "bye\n", true)).await.unwrap();
    assert_eq!(
        store.shipped(&k).await.unwrap(),
        Some(Shipped {
            next_offset: 16,
            ended: true
        })
    );
    // Read whole, and a chunk at a time: the same.
    assert_eq!(
        all(store, &k, 1 << 20).await,
        (0, "hello world\nbye\n".into(), true)
    );
    assert_eq!(
        all(store, &k, 1).await,
        (0, "hello world\nbye\n".into(), true)
    );
}

async fn a_chunk_shipped_twice_is_kept_once<S: OutputStore>(store: &S) {
    let k = key(2, "node-a");
    store.append(&k, chunk(0, "one\n", false)).await.unwrap();
    store.append(&k, chunk(0, "one\n", false)).await.unwrap();
    store.append(&k, chunk(4, "two\n", false)).await.unwrap();
    store.append(&k, chunk(4, "two\n", false)).await.unwrap();
    assert_eq!(all(store, &k, 1 << 20).await.1, "one\ntwo\n");
}

async fn runs_and_nodes_are_kept_apart<S: OutputStore>(store: &S) {
    let (a, b, c) = (key(1, "node-a"), key(1, "node-b"), key(2, "node-a"));
    store.append(&a, chunk(0, "rank 0\n", true)).await.unwrap();
    store.append(&b, chunk(0, "rank 1\n", true)).await.unwrap();
    store.append(&c, chunk(0, "again\n", false)).await.unwrap();
    let other = RunKey {
        workload: Uuid::from_u128(0x9999),
        ..a.clone()
    };
    store
        .append(&other, chunk(0, "other\n", false))
        .await
        .unwrap();
    assert_eq!(
        store.runs(a.workload).await.unwrap(),
        vec![
            (1, "node-a".to_owned()),
            (1, "node-b".to_owned()),
            (2, "node-a".to_owned())
        ]
    );
    assert_eq!(all(store, &b, 1 << 20).await.1, "rank 1\n");
    assert_eq!(all(store, &c, 1 << 20).await, (0, "again\n".into(), false));
    assert!(store.runs(Uuid::from_u128(5)).await.unwrap().is_empty());
}

/// With `max_chunks` 4: the oldest chunks go, and the reader sees where what is kept starts.
async fn a_long_run_keeps_its_newest_chunks<S: OutputStore>(store: &S) {
    let k = key(3, "node-a");
    let mut offset = 0;
    for i in 0..10 {
        let line = format!("line {i}\n");
        store.append(&k, chunk(offset, &line, false)).await.unwrap();
        offset += line.len() as u64;
    }
    let (first, text, _) = all(store, &k, 1 << 20).await;
    assert_eq!(text, "line 6\nline 7\nline 8\nline 9\n");
    assert_eq!(
        first,
        6 * 7,
        "what was dropped is said by where the rest starts"
    );
    assert_eq!(
        store.shipped(&k).await.unwrap().unwrap().next_offset,
        offset
    );
}

fn limits() -> OutputLimits {
    OutputLimits {
        max_chunks: 4,
        ..OutputLimits::default()
    }
}

struct Embedded {
    _dir: tempfile::TempDir,
    store: eventlog::output::EmbeddedOutput,
}

fn embedded(limits: OutputLimits) -> Embedded {
    let dir = tempfile::tempdir().unwrap();
    let log = EmbeddedLog::open(dir.path()).unwrap();
    let store = log.output(limits).unwrap();
    Embedded { _dir: dir, store }
}

struct OnNats {
    _server: NatsServer,
    store: eventlog::output::JetStreamOutput,
}

async fn on_nats() -> OnNats {
    let server = NatsServer::start();
    let log = JetStreamLog::connect(&server.url(), JetStreamOptions::default())
        .await
        .unwrap();
    let store = log.output(&limits()).await.unwrap();
    OnNats {
        _server: server,
        store,
    }
}

macro_rules! conformance {
    ($($case:ident),* $(,)?) => {
        mod embedded {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let f = super::embedded(super::limits());
                    super::$case(&f.store).await;
                }
            )*
        }
        mod jetstream {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let f = super::on_nats().await;
                    super::$case(&f.store).await;
                }
            )*
        }
    };
}

conformance!(
    output_reads_back_in_order_and_says_where_it_stands,
    a_chunk_shipped_twice_is_kept_once,
    runs_and_nodes_are_kept_apart,
    a_long_run_keeps_its_newest_chunks,
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_store_bounds_a_run_in_bytes_and_drops_old_runs() {
    let f = embedded(OutputLimits {
        max_bytes: 20,
        max_age: Duration::from_secs(60),
        ..OutputLimits::default()
    });
    let k = key(1, "node-a");
    for i in 0..5u64 {
        f.store
            .append(&k, chunk(i * 10, "123456789\n", false))
            .await
            .unwrap();
    }
    let (first, text, _) = all(&f.store, &k, 1 << 20).await;
    assert_eq!((first, text.len()), (30, 20));
    let now = chunk(0, "", false).at_ms;
    assert_eq!(f.store.sweep(now).unwrap(), 0, "a minute has not passed");
    assert_eq!(f.store.sweep(now + 61_000).unwrap(), 1);
    assert_eq!(f.store.shipped(&k).await.unwrap(), None);
    assert!(f.store.runs(k.workload).await.unwrap().is_empty());
}
