//! The output of runs: what a workload writes on stdout and stderr, shipped by its node's agent
//! a chunk at a time as it is written, kept bounded per run and by age, and read back by the
//! API (`GET /v1/workloads/{id}/logs`) while the run goes on and after it ended.
//!
//! Output is not part of the ledger: nothing is folded from it, and what is dropped to keep it
//! bounded is said (a reader sees where the kept output starts). Each run of a workload on
//! each of its nodes has its own output, a sequence of bytes; a chunk carries its byte offset
//! in it, so a chunk shipped twice (an agent that retried, or restarted) is kept once, and the
//! last chunk of a run says it is the last.
//!
//! - [`EmbeddedOutput`]: a tree of the embedded log's sled database.
//! - [`JetStreamOutput`]: the `OUTPUT` stream, one subject per run and node
//!   (`fairledger.output.<node>.<workload>.<run>`), so that an agent's NATS user may publish
//!   its own node's output only.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::header::HeaderMap;
use async_nats::jetstream::{self, stream};
use bytes::Bytes;
use uuid::Uuid;

use crate::jetstream::ConnectError;
use crate::LogError;

/// Prefix of every output subject (the `OUTPUT` stream).
pub const OUTPUT_PREFIX: &str = "fairledger.output";
/// The stream that keeps runs' output on NATS.
pub const OUTPUT_STREAM: &str = "OUTPUT";
/// The most bytes one chunk carries.
pub const CHUNK_MAX: usize = 64 * 1024;

const OFFSET_HEADER: &str = "Fairledger-Offset";
const END_HEADER: &str = "Fairledger-End";
const AT_HEADER: &str = "Fairledger-At";

/// One run of a workload on one node: whose output.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RunKey {
    /// The workload.
    pub workload: Uuid,
    /// Its run: 1 for its first start, 2 for the next…
    pub run: u64,
    /// The node it ran on (a gang's runs have one output per node).
    pub node: String,
}

impl RunKey {
    /// Its subject on NATS.
    pub fn subject(&self) -> String {
        format!(
            "{OUTPUT_PREFIX}.{}.{}.{}",
            crate::subject::token(&self.node),
            self.workload,
            self.run
        )
    }
}

/// A piece of a run's output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// Where its first byte is in the run's output.
    pub offset: u64,
    /// The bytes, at most [`CHUNK_MAX`].
    pub data: Bytes,
    /// The run ended and this is the end of its output.
    pub end: bool,
    /// When it was shipped, milliseconds since the epoch.
    pub at_ms: u64,
}

/// How much output is kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutputLimits {
    /// The most bytes kept of one run on one node: older chunks are dropped first.
    pub max_bytes: u64,
    /// The most chunks kept of one run on one node (on NATS the bound that stands for bytes:
    /// at most this many of [`CHUNK_MAX`] each).
    pub max_chunks: u32,
    /// Output older than this is dropped, run by run.
    pub max_age: Duration,
    /// The most bytes the `OUTPUT` stream keeps in all (NATS only; oldest dropped first).
    pub max_total_bytes: u64,
}

impl Default for OutputLimits {
    fn default() -> Self {
        OutputLimits {
            max_bytes: 16 << 20,
            max_chunks: 2048,
            max_age: Duration::from_secs(7 * 86_400),
            max_total_bytes: 1 << 30,
        }
    }
}

/// Where a run's shipped output stands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Shipped {
    /// The offset of the next byte to ship.
    pub next_offset: u64,
    /// Its last chunk was shipped.
    pub ended: bool,
}

/// Chunks read, in order of offset.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Page {
    /// The chunks.
    pub chunks: Vec<Chunk>,
    /// Pass it back to read on from here.
    pub cursor: u64,
}

/// Where runs' output is kept: shipped by agents, read by the API.
pub trait OutputStore: Send + Sync + 'static {
    /// Keeps `chunk` of `key`'s output. A chunk already kept (the same offset, shipped again) is
    /// kept once; output after the run's last chunk is ignored.
    fn append(
        &self,
        key: &RunKey,
        chunk: Chunk,
    ) -> impl Future<Output = Result<(), LogError>> + Send;

    /// Where `key`'s shipped output stands; `None` when none was shipped (or all was dropped by
    /// age).
    fn shipped(
        &self,
        key: &RunKey,
    ) -> impl Future<Output = Result<Option<Shipped>, LogError>> + Send;

    /// Chunks of `key` after `cursor` (0: from the oldest kept), about `max_bytes` of them at
    /// most, oldest first; [`Page::cursor`] reads on.
    fn read(
        &self,
        key: &RunKey,
        cursor: u64,
        max_bytes: usize,
    ) -> impl Future<Output = Result<Page, LogError>> + Send;

    /// The runs of `workload` with output kept, and on which nodes: `(run, node)` in order.
    fn runs(
        &self,
        workload: Uuid,
    ) -> impl Future<Output = Result<Vec<(u64, String)>, LogError>> + Send;
}

/// Either store, as the log's backend is.
#[derive(Clone)]
pub enum AnyOutput {
    /// In the embedded log's database.
    Embedded(EmbeddedOutput),
    /// On the `OUTPUT` stream.
    JetStream(JetStreamOutput),
}

impl OutputStore for AnyOutput {
    async fn append(&self, key: &RunKey, chunk: Chunk) -> Result<(), LogError> {
        match self {
            AnyOutput::Embedded(o) => o.append(key, chunk).await,
            AnyOutput::JetStream(o) => o.append(key, chunk).await,
        }
    }

    async fn shipped(&self, key: &RunKey) -> Result<Option<Shipped>, LogError> {
        match self {
            AnyOutput::Embedded(o) => o.shipped(key).await,
            AnyOutput::JetStream(o) => o.shipped(key).await,
        }
    }

    async fn read(&self, key: &RunKey, cursor: u64, max_bytes: usize) -> Result<Page, LogError> {
        match self {
            AnyOutput::Embedded(o) => o.read(key, cursor, max_bytes).await,
            AnyOutput::JetStream(o) => o.read(key, cursor, max_bytes).await,
        }
    }

    async fn runs(&self, workload: Uuid) -> Result<Vec<(u64, String)>, LogError> {
        match self {
            AnyOutput::Embedded(o) => o.runs(workload).await,
            AnyOutput::JetStream(o) => o.runs(workload).await,
        }
    }
}

/// What of `chunk` is new after `shipped`: `None` when nothing is (a repeat, or output after
/// the end); a chunk overlapping what is kept loses its first bytes.
fn new_part(shipped: Shipped, mut chunk: Chunk) -> Option<Chunk> {
    if shipped.ended {
        return None;
    }
    let end = chunk.offset + chunk.data.len() as u64;
    if end < shipped.next_offset || (end == shipped.next_offset && !chunk.end) {
        return None;
    }
    if chunk.offset < shipped.next_offset {
        let skip = (shipped.next_offset - chunk.offset) as usize;
        chunk.data = chunk.data.slice(skip..);
        chunk.offset = shipped.next_offset;
    }
    Some(chunk)
}

// ---------------------------------------------------------------------------------------------
// Embedded

/// Output in a tree of the embedded log's sled database:
///
/// ```text
/// m <workload:16> <run:8> <node> 0                 first, next, bytes, chunks, last_at, ended
/// c <workload:16> <run:8> <node> 0 <offset:8>      at_ms:8, end:1, data
/// ```
#[derive(Clone)]
pub struct EmbeddedOutput {
    tree: sled::Tree,
    limits: OutputLimits,
    /// One append at a time: each reads and rewrites its run's record.
    appending: Arc<tokio::sync::Mutex<()>>,
    swept_at_ms: Arc<AtomicU64>,
}

/// How often the embedded store drops output past its age.
const SWEEP_EVERY_MS: u64 = 10 * 60_000;

#[derive(Clone, Copy, Debug, Default)]
struct Meta {
    first: u64,
    next: u64,
    bytes: u64,
    chunks: u32,
    last_at_ms: u64,
    ended: bool,
}

impl Meta {
    fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(37);
        v.extend_from_slice(&self.first.to_be_bytes());
        v.extend_from_slice(&self.next.to_be_bytes());
        v.extend_from_slice(&self.bytes.to_be_bytes());
        v.extend_from_slice(&self.chunks.to_be_bytes());
        v.extend_from_slice(&self.last_at_ms.to_be_bytes());
        v.push(u8::from(self.ended));
        v
    }

    fn decode(v: &[u8]) -> Option<Meta> {
        let u64_at = |at: usize| Some(u64::from_be_bytes(v.get(at..at + 8)?.try_into().ok()?));
        Some(Meta {
            first: u64_at(0)?,
            next: u64_at(8)?,
            bytes: u64_at(16)?,
            chunks: u32::from_be_bytes(v.get(24..28)?.try_into().ok()?),
            last_at_ms: u64_at(28)?,
            ended: *v.get(36)? != 0,
        })
    }
}

fn run_prefix(tag: u8, key: &RunKey) -> Vec<u8> {
    let mut k = Vec::with_capacity(26 + key.node.len());
    k.push(tag);
    k.extend_from_slice(key.workload.as_bytes());
    k.extend_from_slice(&key.run.to_be_bytes());
    k.extend_from_slice(key.node.as_bytes());
    k.push(0);
    k
}

fn chunk_key(key: &RunKey, offset: u64) -> Vec<u8> {
    let mut k = run_prefix(b'c', key);
    k.extend_from_slice(&offset.to_be_bytes());
    k
}

fn corrupt(reason: &str) -> LogError {
    LogError::Corrupt {
        seq: 0,
        reason: format!("output store: {reason}"),
    }
}

fn decode_chunk(k: &[u8], v: &[u8]) -> Result<Chunk, LogError> {
    let offset = k
        .len()
        .checked_sub(8)
        .and_then(|at| k[at..].try_into().ok())
        .map(u64::from_be_bytes)
        .ok_or_else(|| corrupt("bad chunk key"))?;
    if v.len() < 9 {
        return Err(corrupt("bad chunk"));
    }
    Ok(Chunk {
        offset,
        at_ms: u64::from_be_bytes(v[..8].try_into().expect("eight bytes")),
        end: v[8] != 0,
        data: Bytes::copy_from_slice(&v[9..]),
    })
}

impl EmbeddedOutput {
    pub(crate) fn new(tree: sled::Tree, limits: OutputLimits) -> Self {
        EmbeddedOutput {
            tree,
            limits,
            appending: Arc::default(),
            swept_at_ms: Arc::default(),
        }
    }

    fn meta(&self, key: &RunKey) -> Result<Option<Meta>, LogError> {
        match self.tree.get(run_prefix(b'm', key)).map_err(unavailable)? {
            None => Ok(None),
            Some(v) => Meta::decode(&v)
                .map(Some)
                .ok_or_else(|| corrupt("bad run record")),
        }
    }

    /// Drops every run whose last output is older than the age limit.
    pub fn sweep(&self, now_ms: u64) -> Result<u64, LogError> {
        let max_age = self.limits.max_age.as_millis() as u64;
        let mut dropped = 0;
        for entry in self.tree.scan_prefix([b'm']) {
            let (k, v) = entry.map_err(unavailable)?;
            let meta = Meta::decode(&v).ok_or_else(|| corrupt("bad run record"))?;
            if meta.last_at_ms.saturating_add(max_age) >= now_ms {
                continue;
            }
            let mut chunks = k.to_vec();
            chunks[0] = b'c';
            for c in self.tree.scan_prefix(&chunks).keys() {
                self.tree
                    .remove(c.map_err(unavailable)?)
                    .map_err(unavailable)?;
            }
            self.tree.remove(k).map_err(unavailable)?;
            dropped += 1;
        }
        Ok(dropped)
    }
}

fn unavailable(e: sled::Error) -> LogError {
    LogError::Unavailable(e.to_string())
}

impl OutputStore for EmbeddedOutput {
    async fn append(&self, key: &RunKey, chunk: Chunk) -> Result<(), LogError> {
        let _one = self.appending.lock().await;
        let now = chunk.at_ms;
        if now.saturating_sub(self.swept_at_ms.load(Ordering::Relaxed)) > SWEEP_EVERY_MS {
            self.swept_at_ms.store(now, Ordering::Relaxed);
            self.sweep(now)?;
        }
        let mut meta = self.meta(key)?.unwrap_or_default();
        let shipped = Shipped {
            next_offset: meta.next,
            ended: meta.ended,
        };
        let Some(chunk) = new_part(shipped, chunk) else {
            return Ok(());
        };
        if meta.chunks == 0 {
            meta.first = chunk.offset;
        }
        let len = chunk.data.len() as u64;
        let mut value = Vec::with_capacity(9 + chunk.data.len());
        value.extend_from_slice(&chunk.at_ms.to_be_bytes());
        value.push(u8::from(chunk.end));
        value.extend_from_slice(&chunk.data);
        self.tree
            .insert(chunk_key(key, chunk.offset), value)
            .map_err(unavailable)?;
        meta.next = chunk.offset + len;
        meta.bytes += len;
        meta.chunks += 1;
        meta.last_at_ms = chunk.at_ms;
        meta.ended = chunk.end;
        // Bounded: the oldest chunks go first.
        let prefix = run_prefix(b'c', key);
        while meta.chunks > 1
            && (meta.bytes > self.limits.max_bytes || meta.chunks > self.limits.max_chunks)
        {
            let Some(oldest) = self.tree.scan_prefix(&prefix).next() else {
                break;
            };
            let (k, v) = oldest.map_err(unavailable)?;
            let dropped = decode_chunk(&k, &v)?;
            self.tree.remove(k).map_err(unavailable)?;
            meta.bytes -= dropped.data.len() as u64;
            meta.chunks -= 1;
            meta.first = dropped.offset + dropped.data.len() as u64;
        }
        self.tree
            .insert(run_prefix(b'm', key), meta.encode())
            .map_err(unavailable)?;
        Ok(())
    }

    async fn shipped(&self, key: &RunKey) -> Result<Option<Shipped>, LogError> {
        Ok(self.meta(key)?.map(|m| Shipped {
            next_offset: m.next,
            ended: m.ended,
        }))
    }

    async fn read(&self, key: &RunKey, cursor: u64, max_bytes: usize) -> Result<Page, LogError> {
        let mut page = Page {
            chunks: Vec::new(),
            cursor,
        };
        let mut bytes = 0;
        let end = run_prefix(b'm', key); // past every chunk key of this run: 'c' < 'm'
        let mut upper = run_prefix(b'c', key);
        upper.extend_from_slice(&u64::MAX.to_be_bytes());
        for entry in self.tree.range(chunk_key(key, cursor)..=upper) {
            let (k, v) = entry.map_err(unavailable)?;
            debug_assert!(k.as_ref() < end.as_slice());
            let chunk = decode_chunk(&k, &v)?;
            if !page.chunks.is_empty() && bytes + chunk.data.len() > max_bytes {
                break;
            }
            bytes += chunk.data.len();
            page.cursor = chunk.offset + 1;
            page.chunks.push(chunk);
        }
        Ok(page)
    }

    async fn runs(&self, workload: Uuid) -> Result<Vec<(u64, String)>, LogError> {
        let mut prefix = vec![b'm'];
        prefix.extend_from_slice(workload.as_bytes());
        let mut out = Vec::new();
        for k in self.tree.scan_prefix(&prefix).keys() {
            let k = k.map_err(unavailable)?;
            let rest = &k[prefix.len()..];
            if rest.len() < 9 {
                return Err(corrupt("bad run key"));
            }
            let run = u64::from_be_bytes(rest[..8].try_into().expect("eight bytes"));
            let node = String::from_utf8_lossy(&rest[8..rest.len() - 1]).into_owned();
            out.push((run, node));
        }
        Ok(out)
    }
}

// ---------------------------------------------------------------------------------------------
// JetStream

/// Output on the `OUTPUT` stream: a message per chunk, its offset (and the end) in headers.
/// A run's chunks are read by direct gets, so readers make no consumer.
#[derive(Clone)]
pub struct JetStreamOutput {
    js: jetstream::Context,
    stream: Arc<stream::Stream<()>>,
}

/// The `OUTPUT` stream's configuration for `limits`.
pub(crate) fn stream_config(limits: &OutputLimits, replicas: usize) -> stream::Config {
    stream::Config {
        name: OUTPUT_STREAM.into(),
        subjects: vec![format!("{OUTPUT_PREFIX}.>")],
        storage: stream::StorageType::File,
        retention: stream::RetentionPolicy::Limits,
        discard: stream::DiscardPolicy::Old,
        max_age: limits.max_age,
        max_messages_per_subject: i64::from(limits.max_chunks),
        max_bytes: i64::try_from(limits.max_total_bytes).unwrap_or(i64::MAX),
        max_message_size: (CHUNK_MAX + 4096) as i32,
        num_replicas: replicas,
        allow_direct: true,
        duplicate_window: Duration::from_secs(120),
        description: Some("fairledger: runs' output, bounded per run and by age".into()),
        ..Default::default()
    }
}

impl JetStreamOutput {
    /// The store on `js`: `ensure` makes or updates the stream (the service does), else it
    /// must exist (agents).
    pub(crate) async fn open(
        js: jetstream::Context,
        limits: &OutputLimits,
        replicas: usize,
        ensure: bool,
    ) -> Result<Self, ConnectError> {
        if ensure {
            crate::jetstream::streams::ensure_stream(&js, stream_config(limits, replicas)).await?;
        }
        let stream =
            js.get_stream_no_info(OUTPUT_STREAM)
                .await
                .map_err(|e| ConnectError::Stream {
                    stream: OUTPUT_STREAM.into(),
                    reason: e.to_string(),
                })?;
        Ok(JetStreamOutput {
            js,
            stream: Arc::new(stream),
        })
    }
}

fn chunk_of(message: &async_nats::jetstream::message::StreamMessage) -> Result<Chunk, LogError> {
    let header = |name: &str| message.headers.get(name).map(|v| v.as_str().to_owned());
    let offset = header(OFFSET_HEADER)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| corrupt("a chunk without its offset"))?;
    Ok(Chunk {
        offset,
        data: message.payload.clone(),
        end: header(END_HEADER).is_some(),
        at_ms: header(AT_HEADER).and_then(|v| v.parse().ok()).unwrap_or(0),
    })
}

fn not_found(e: &async_nats::jetstream::stream::DirectGetError) -> bool {
    matches!(
        e.kind(),
        async_nats::jetstream::stream::DirectGetErrorKind::NotFound
    )
}

impl OutputStore for JetStreamOutput {
    async fn append(&self, key: &RunKey, chunk: Chunk) -> Result<(), LogError> {
        let failed = |e: &dyn std::fmt::Display| LogError::Unavailable(e.to_string());
        let mut headers = HeaderMap::new();
        headers.insert(OFFSET_HEADER, chunk.offset.to_string().as_str());
        headers.insert(AT_HEADER, chunk.at_ms.to_string().as_str());
        let mut id = format!("{}.{}", key.subject(), chunk.offset);
        if chunk.end {
            headers.insert(END_HEADER, "1");
            id.push_str(".end");
        }
        headers.insert(async_nats::header::NATS_MESSAGE_ID, id.as_str());
        self.js
            .publish_with_headers(key.subject(), headers, chunk.data)
            .await
            .map_err(|e| failed(&e))?
            .await
            .map_err(|e| failed(&e))?;
        Ok(())
    }

    async fn shipped(&self, key: &RunKey) -> Result<Option<Shipped>, LogError> {
        match self.stream.direct_get_last_for_subject(key.subject()).await {
            Ok(m) => {
                let c = chunk_of(&m)?;
                Ok(Some(Shipped {
                    next_offset: c.offset + c.data.len() as u64,
                    ended: c.end,
                }))
            }
            Err(e) if not_found(&e) => Ok(None),
            Err(e) => Err(LogError::Unavailable(e.to_string())),
        }
    }

    async fn read(&self, key: &RunKey, cursor: u64, max_bytes: usize) -> Result<Page, LogError> {
        let subject = key.subject();
        let mut page = Page {
            chunks: Vec::new(),
            cursor,
        };
        let mut bytes = 0;
        loop {
            let m = match self
                .stream
                .direct_get_next_for_subject(subject.as_str(), Some(page.cursor.max(1)))
                .await
            {
                Ok(m) => m,
                Err(e) if not_found(&e) => break,
                Err(e) => return Err(LogError::Unavailable(e.to_string())),
            };
            let chunk = chunk_of(&m)?;
            page.cursor = m.sequence + 1;
            bytes += chunk.data.len();
            page.chunks.push(chunk);
            if bytes >= max_bytes {
                break;
            }
        }
        // In offset order as readers expect; a chunk shipped again outside the duplicate window
        // is read twice, and readers skip what they already have by its offset.
        page.chunks.sort_by_key(|c| c.offset);
        Ok(page)
    }

    async fn runs(&self, workload: Uuid) -> Result<Vec<(u64, String)>, LogError> {
        let filter = format!("{OUTPUT_PREFIX}.*.{workload}.*");
        let stream = (*self.stream).clone();
        let mut info = stream
            .info_with_subjects(filter)
            .await
            .map_err(|e| LogError::Unavailable(e.to_string()))?;
        let mut out = Vec::new();
        use futures::TryStreamExt;
        while let Some((subject, _count)) = info
            .try_next()
            .await
            .map_err(|e| LogError::Unavailable(e.to_string()))?
        {
            let mut tokens = subject.rsplitn(4, '.');
            let run = tokens.next().and_then(|r| r.parse().ok());
            let _workload = tokens.next();
            let node = tokens.next();
            if let (Some(run), Some(node)) = (run, node) {
                out.push((run, node.to_owned()));
            }
        }
        out.sort();
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn now_ms() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    }

    fn chunk(offset: u64, data: &'static str, end: bool) -> Chunk {
        Chunk {
            offset,
            data: Bytes::from_static(data.as_bytes()),
            end,
            at_ms: now_ms(),
        }
    }

    #[test]
    fn a_chunk_kept_before_is_not_kept_again_and_an_overlap_loses_its_head() {
        let at = |next, ended| Shipped {
            next_offset: next,
            ended,
        };
        assert_eq!(new_part(at(5, false), chunk(0, "hello", false)), None);
        assert_eq!(
            new_part(at(3, false), chunk(0, "hello", false)).map(|c| (c.offset, c.data)),
            Some((3, Bytes::from_static(b"lo")))
        );
        assert!(new_part(at(5, false), chunk(5, "", true)).is_some());
        assert_eq!(new_part(at(5, true), chunk(5, "more", false)), None);
        // A gap (output dropped before it was shipped) is kept as it comes.
        assert_eq!(
            new_part(at(5, false), chunk(9, "x", false)).unwrap().offset,
            9
        );
    }
}
