//! The embedded event log: an append-only log in sled, for a single process.
//!
//! One sled tree holds three key spaces: `b<first seq>` blocks of consecutive events, `k<window
//! number><key>` idempotency keys and `s<subject>` the last sequence of each subject. A single
//! writer thread gathers whatever appends are waiting into one atomic sled batch (group commit)
//! and hands it to a flusher thread, which flushes to disk everything written so far and only
//! then answers: one fsync serves every concurrent writer, and nothing is acknowledged before it
//! is durable. The two overlap: while one flush is under way the writer checks and writes the
//! next group, which the next flush covers. Readers see only what has been flushed.
//!
//! What the log holds in memory is bounded by its recent traffic, not by its history: sled keeps
//! a few hundred bytes per page of at most 16 keys whether or not the page is cached, so events
//! are kept [`BLOCK_EVENTS`] (or [`BLOCK_BYTES`]) to a key — the writer fills the last block
//! until it is full — and idempotency keys are kept for a duplicate window, as JetStream keeps
//! them ([`DUPLICATE_WINDOW`]): a key is remembered for at least one window and at most two, in
//! numbered windows of which the writer deletes the expired ones a little at a time. A log
//! written with one key per event (and idempotency keys kept for ever) is converted once when
//! it is opened.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use futures::stream::BoxStream;
use futures::StreamExt;
use tokio::sync::{mpsc, oneshot, watch};

use crate::{subject_matches, Append, AppendError, Appended, EventLog, Expect, LogError, Stored};

mod convert;
mod dedupe;

use convert::*;
use dedupe::*;

/// Most appends gathered into one group commit.
const GROUP_MAX: usize = 4096;
/// Groups written and waiting for a flush before the writer waits too.
const FLUSH_QUEUE: usize = 64;
/// Events read per range scan by a subscription.
const READ_CHUNK: usize = 1024;
/// The file beside sled's holding the last acknowledged sequence.
const HIGH_WATER: &str = "high-water";
/// Most events kept in one block.
pub const BLOCK_EVENTS: usize = 64;
/// A block takes no more events once it holds this many bytes (so a leaf of 16 blocks stays
/// under sled's inline limit).
pub const BLOCK_BYTES: usize = 4096;
/// How long an idempotency key is remembered at least (JetStream's default duplicate window
/// in this product); it is forgotten within twice that.
pub const DUPLICATE_WINDOW: std::time::Duration = std::time::Duration::from_secs(10 * 60);
/// Expired idempotency keys deleted per group commit at most.
const EXPIRE_PER_GROUP: usize = 1024;
/// Events converted per sled batch when a log with one key per event is opened.
const CONVERT_CHUNK: usize = 65_536;

/// Why the embedded log could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// Another process holds the directory.
    #[error("the event log in {0} is in use by another process; stop it or pass another --data directory")]
    Locked(PathBuf),
    /// sled could not open or read the directory.
    #[error("cannot open the event log in {dir}: {reason}; check the path and free disk space, or restore the directory from a backup")]
    Storage {
        /// The directory.
        dir: PathBuf,
        /// sled's message.
        reason: String,
    },
    /// The data does not decode: the directory was damaged.
    #[error("the event log in {dir} is corrupt ({reason}); it is the source of truth, so restore it from a backup (the projection, not the log, can be rebuilt)")]
    Corrupt {
        /// The directory.
        dir: PathBuf,
        /// What failed.
        reason: String,
    },
}

type Answer = oneshot::Sender<Result<Vec<Appended>, AppendError>>;

/// The embedded, sled-backed [`EventLog`]. Cheap to clone; the writer stops when the last
/// clone is dropped.
#[derive(Clone)]
pub struct EmbeddedLog {
    tree: sled::Tree,
    writer: mpsc::Sender<(Vec<Append>, Answer)>,
    durable: watch::Receiver<u64>,
    _db: Arc<sled::Db>,
    /// Makes every flush from now on fail, as a full or broken disk would.
    #[cfg(test)]
    fail_flushes: Arc<std::sync::atomic::AtomicBool>,
}

impl EmbeddedLog {
    /// Opens (or creates) the log in `dir`.
    pub fn open(dir: &Path) -> Result<Self, OpenError> {
        Self::open_with_window(dir, DUPLICATE_WINDOW)
    }

    /// Opens the log in `dir` remembering idempotency keys for `window` (tests of the window).
    #[doc(hidden)]
    pub fn open_with_window(dir: &Path, window: std::time::Duration) -> Result<Self, OpenError> {
        let corrupt = |reason: String| OpenError::Corrupt {
            dir: dir.to_owned(),
            reason,
        };
        let storage = |reason: String| OpenError::Storage {
            dir: dir.to_owned(),
            reason,
        };
        let (mut db, mut tree) = open_tree(dir)?;
        if tree.scan_prefix(b"e").next().is_some() || tree.scan_prefix(b"d").next().is_some() {
            convert_per_event_keys(dir, &tree).map_err(|e| match e {
                LogError::Corrupt { seq, reason } => corrupt(format!("event {seq}: {reason}")),
                other => storage(other.to_string()),
            })?;
            drop((tree, db));
            (db, tree) = open_tree(dir)?;
        }
        let block = match tree.scan_prefix(b"b").next_back() {
            None => Block::starting(1),
            Some(entry) => {
                let (k, v) = entry.map_err(|e| open_error(dir, e))?;
                let first = seq_of_key(&k).ok_or_else(|| corrupt("bad block key".into()))?;
                Block::stored(first, &v).map_err(|e| corrupt(format!("last block: {e}")))?
            }
        };
        let last_seq = block.first + block.count as u64 - 1;
        let dedupe = Dedupe::open(&tree, window).map_err(|e| open_error(dir, e))?;
        let mut subjects = HashMap::new();
        for entry in tree.scan_prefix(b"s") {
            let (k, v) = entry.map_err(|e| open_error(dir, e))?;
            let subject = String::from_utf8(k[1..].to_vec())
                .map_err(|_| corrupt("subject is not UTF-8".into()))?;
            let seq = u64_of(&v).ok_or_else(|| corrupt("bad subject sequence".into()))?;
            if seq > last_seq {
                return Err(corrupt(format!(
                    "subject {subject} claims sequence {seq} past the last event {last_seq}"
                )));
            }
            subjects.insert(subject, seq);
        }
        // The high-water mark: the last sequence ever acknowledged, written after each flush.
        // A log that opens shorter than it lost acknowledged events to damage.
        let mark_path = dir.join(HIGH_WATER);
        let mark = match std::fs::read_to_string(&mark_path) {
            Ok(text) => text.trim().parse::<u64>().ok(),
            Err(_) => None,
        };
        if let Some(mark) = mark.filter(|&m| m > last_seq) {
            return Err(corrupt(format!(
                "it holds events up to sequence {last_seq} but had acknowledged up to {mark}"
            )));
        }
        let high_water = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&mark_path)
            .map_err(|e| OpenError::Storage {
                dir: dir.to_owned(),
                reason: format!("{}: {e}", mark_path.display()),
            })?;
        let (durable_tx, durable) = watch::channel(last_seq);
        let (writer, rx) = mpsc::channel(GROUP_MAX);
        let db = Arc::new(db);
        let failed = Arc::new(std::sync::Mutex::new(None));
        let (to_flusher, written) = std::sync::mpsc::sync_channel(FLUSH_QUEUE);
        #[cfg(test)]
        let fail_flushes = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flusher = Flusher {
            db: db.clone(),
            durable: durable_tx,
            failed: failed.clone(),
            high_water,
            #[cfg(test)]
            fail: fail_flushes.clone(),
        };
        let state = Writer {
            tree: tree.clone(),
            last_seq,
            subjects,
            block,
            dedupe,
            failed,
            flusher: to_flusher,
        };
        let spawn_error = |e: std::io::Error| OpenError::Storage {
            dir: dir.to_owned(),
            reason: e.to_string(),
        };
        std::thread::Builder::new()
            .name("eventlog-flusher".into())
            .spawn(move || flusher.run(written))
            .map_err(spawn_error)?;
        std::thread::Builder::new()
            .name("eventlog-writer".into())
            .spawn(move || state.run(rx))
            .map_err(spawn_error)?;
        Ok(EmbeddedLog {
            tree,
            writer,
            durable,
            _db: db,
            #[cfg(test)]
            fail_flushes,
        })
    }

    /// The store of runs' output in this log's database, keeping what `limits` allow.
    pub fn output(
        &self,
        limits: crate::output::OutputLimits,
    ) -> Result<crate::output::EmbeddedOutput, LogError> {
        let tree = self
            ._db
            .open_tree("output")
            .map_err(|e| LogError::Unavailable(e.to_string()))?;
        Ok(crate::output::EmbeddedOutput::new(tree, limits))
    }

    fn read_range(&self, from: u64, max: usize) -> Result<Vec<Stored>, LogError> {
        let last = *self.durable.borrow();
        let from = from.max(1);
        if from > last || max == 0 {
            return Ok(Vec::new());
        }
        let unavailable = |e: sled::Error| LogError::Unavailable(e.to_string());
        // The block holding `from` is the last one starting at or before it.
        let start = match self.tree.range(key(b'b', 0)..=key(b'b', from)).next_back() {
            Some(entry) => entry.map_err(unavailable)?.0,
            None => {
                return Err(LogError::Corrupt {
                    seq: from,
                    reason: "no block holds it".into(),
                })
            }
        };
        let want = max.min((last - from + 1) as usize);
        let mut out = Vec::with_capacity(want);
        for entry in self.tree.range(start.to_vec()..=key(b'b', last).to_vec()) {
            let (k, v) = entry.map_err(unavailable)?;
            let first = seq_of_key(&k).ok_or_else(|| LogError::Corrupt {
                seq: from,
                reason: "bad block key".into(),
            })?;
            for (seq, record) in records(first, &v)? {
                if seq >= from && seq <= last {
                    out.push(decode(seq, record)?);
                    if out.len() == want {
                        return Ok(out);
                    }
                }
            }
        }
        Ok(out)
    }
}

impl EventLog for EmbeddedLog {
    async fn append_batch(&self, appends: Vec<Append>) -> Result<Vec<Appended>, AppendError> {
        let (tx, rx) = oneshot::channel();
        self.writer
            .send((appends, tx))
            .await
            .map_err(|_| AppendError::Unavailable("the event log writer has stopped".into()))?;
        rx.await
            .map_err(|_| AppendError::Unacknowledged("the event log writer stopped".into()))?
    }

    async fn last_seq(&self) -> Result<u64, LogError> {
        Ok(*self.durable.borrow())
    }

    async fn read(&self, from: u64, max: usize) -> Result<Vec<Stored>, LogError> {
        self.read_range(from, max)
    }

    async fn subscribe(
        &self,
        from: u64,
    ) -> Result<BoxStream<'static, Result<Stored, LogError>>, LogError> {
        let log = self.clone();
        let durable = self.durable.clone();
        let stream = futures::stream::unfold(
            (log, durable, from.max(1), false),
            |(log, mut durable, next, failed)| async move {
                if failed {
                    return None;
                }
                loop {
                    match log.read_range(next, READ_CHUNK) {
                        Err(e) => return Some((vec![Err(e)], (log, durable, next, true))),
                        Ok(events) if !events.is_empty() => {
                            let after = events.last().map_or(next, |e| e.seq + 1);
                            let items = events.into_iter().map(Ok).collect();
                            return Some((items, (log, durable, after, false)));
                        }
                        Ok(_) => {
                            if durable.changed().await.is_err() {
                                return None;
                            }
                        }
                    }
                }
            },
        )
        .flat_map(futures::stream::iter);
        Ok(stream.boxed())
    }
}

/// Checks and writes groups of appends, in sequence order, and hands them to the flusher.
struct Writer {
    tree: sled::Tree,
    /// The last sequence written (durable or about to be).
    last_seq: u64,
    subjects: HashMap<String, u64>,
    /// The last block, which takes the next events until it is full.
    block: Block,
    /// The idempotency keys' windows.
    dedupe: Dedupe,
    /// Why the log stopped, once it has: shared with the flusher, which finds most failures.
    failed: Arc<std::sync::Mutex<Option<String>>>,
    flusher: std::sync::mpsc::SyncSender<Written>,
}

/// A group written but not yet flushed: the last sequence it reached, and its answers.
struct Written {
    last_seq: u64,
    answers: Vec<(Answer, Result<Vec<Appended>, AppendError>)>,
}

/// Makes written groups durable and answers them.
struct Flusher {
    db: Arc<sled::Db>,
    durable: watch::Sender<u64>,
    failed: Arc<std::sync::Mutex<Option<String>>>,
    high_water: std::fs::File,
    #[cfg(test)]
    fail: Arc<std::sync::atomic::AtomicBool>,
}

impl Flusher {
    fn flush(&self) -> sled::Result<()> {
        #[cfg(test)]
        if self.fail.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(sled::Error::Io(std::io::Error::other("injected")));
        }
        self.db.flush().map(|_| ())
    }

    fn run(self, written: std::sync::mpsc::Receiver<Written>) {
        while let Ok(first) = written.recv() {
            // One flush covers every group written so far.
            let mut groups = vec![first];
            groups.extend(written.try_iter());
            let last_seq = groups.last().map_or(0, |g| g.last_seq);
            let stopped = self.failed.lock().expect("never poisoned").clone();
            let flushed = match stopped {
                Some(reason) => Err(reason),
                None => self.flush().map_err(|e| {
                    let reason = format!(
                        "writing to disk failed ({e}); free disk space and restart fairledger"
                    );
                    *self.failed.lock().expect("never poisoned") = Some(reason.clone());
                    reason
                }),
            };
            if let Err(reason) = &flushed {
                // What reached the disk is unknown, which is why these appends are reported as
                // unacknowledged (a retry with the same key after the restart is safe). So is
                // a duplicate: its original may be one of the appends whose flush failed.
                for (answer, result) in groups.into_iter().flat_map(|g| g.answers) {
                    let result = match result {
                        Ok(_) => Err(AppendError::Unacknowledged(reason.clone())),
                        other => other,
                    };
                    let _ = answer.send(result);
                }
                continue;
            }
            if last_seq > *self.durable.borrow() {
                // Fixed width, so an overwrite in place never leaves a longer old value behind.
                let mark = format!("{last_seq:020}\n");
                if let Err(e) =
                    std::os::unix::fs::FileExt::write_all_at(&self.high_water, mark.as_bytes(), 0)
                {
                    tracing::warn!(error = %e, "cannot record the log's high-water mark");
                }
                self.durable.send_replace(last_seq);
            }
            for (answer, result) in groups.into_iter().flat_map(|g| g.answers) {
                let _ = answer.send(result);
            }
        }
    }
}

/// What a group has written so far, on top of the durable log.
#[derive(Default)]
struct Overlay {
    subjects: HashMap<String, u64>,
    ids: HashMap<String, u64>,
}

impl Writer {
    fn run(mut self, mut rx: mpsc::Receiver<(Vec<Append>, Answer)>) {
        while let Some(first) = rx.blocking_recv() {
            let mut group = vec![first];
            let mut events = group[0].0.len();
            while events < GROUP_MAX {
                match rx.try_recv() {
                    Ok(unit) => {
                        events += unit.0.len();
                        group.push(unit);
                    }
                    Err(_) => break,
                }
            }
            self.commit(group);
        }
    }

    fn commit(&mut self, group: Vec<(Vec<Append>, Answer)>) {
        let stopped = self.failed.lock().expect("never poisoned").clone();
        if let Some(reason) = stopped {
            for (_, answer) in group {
                let _ = answer.send(Err(AppendError::Unavailable(reason.clone())));
            }
            return;
        }
        let mut batch = sled::Batch::default();
        let mut overlay = Overlay::default();
        let mut next = self.last_seq;
        let mut answers = Vec::with_capacity(group.len());
        let window = self.dedupe.now();
        for (appends, answer) in group {
            let result = self.check(&appends, next, &overlay, window);
            if let Ok(Checked::Fresh) = result {
                let mut acks = Vec::with_capacity(appends.len());
                for a in appends {
                    next += 1;
                    self.block.add(next, &encode(&a), &mut batch);
                    if let Some(id) = &a.msg_id {
                        batch.insert(dedupe_key(window, id), &next.to_be_bytes());
                        overlay.ids.insert(id.clone(), next);
                    }
                    overlay.subjects.insert(a.subject, next);
                    acks.push(Appended {
                        seq: next,
                        duplicate: false,
                    });
                }
                answers.push((answer, Ok(acks)));
            } else {
                let result = result.map(|checked| match checked {
                    Checked::Duplicate(seq) => vec![Appended {
                        seq,
                        duplicate: true,
                    }],
                    Checked::Fresh => unreachable!("handled above"),
                });
                answers.push((answer, result));
            }
        }
        if next > self.last_seq {
            self.block.write_to(&mut batch);
            // Each subject's last sequence once per group, not once per event.
            for (subject, seq) in &overlay.subjects {
                batch.insert(prefixed(b's', subject.as_bytes()), &seq.to_be_bytes());
            }
            self.dedupe.note(window);
            self.dedupe.expire(&self.tree, window, &mut batch);
            if let Err(e) = self.tree.apply_batch(batch) {
                // The log stops here; the flusher reports this group's appends (and those
                // written before it but not yet flushed) as unacknowledged.
                *self.failed.lock().expect("never poisoned") = Some(format!(
                    "writing to disk failed ({e}); free disk space and restart fairledger"
                ));
            } else {
                self.last_seq = next;
                self.subjects.extend(overlay.subjects);
            }
        }
        // Every answer waits for the flush, even one that wrote nothing: a duplicate's original
        // or a conflict's sequence may be in a group not yet flushed.
        let written = Written {
            last_seq: self.last_seq,
            answers,
        };
        if let Err(unsent) = self.flusher.send(written) {
            for (answer, _) in unsent.0.answers {
                let _ = answer.send(Err(AppendError::Unacknowledged(
                    "the event log's flusher stopped".into(),
                )));
            }
        }
    }

    fn check(
        &self,
        appends: &[Append],
        next: u64,
        overlay: &Overlay,
        window: u32,
    ) -> Result<Checked, AppendError> {
        if appends.is_empty() {
            return Err(AppendError::Refused(
                "an empty batch appends nothing".into(),
            ));
        }
        if appends.len() > crate::MAX_BATCH {
            return Err(AppendError::Refused(format!(
                "a batch may hold at most {} events, not {}",
                crate::MAX_BATCH,
                appends.len()
            )));
        }
        for a in appends {
            crate::check_subject(&a.subject)?;
        }
        let known = |id: &str| -> Result<Option<u64>, AppendError> {
            if let Some(&seq) = overlay.ids.get(id) {
                return Ok(Some(seq));
            }
            self.dedupe
                .find(&self.tree, window, id)
                .map_err(|e| AppendError::Unavailable(e.to_string()))
        };
        if let [single] = appends {
            if let Some(id) = &single.msg_id {
                if let Some(seq) = known(id)? {
                    return Ok(Checked::Duplicate(seq));
                }
            }
        } else {
            let mut seen = std::collections::HashSet::new();
            for id in appends.iter().filter_map(|a| a.msg_id.as_deref()) {
                if !seen.insert(id) || known(id)?.is_some() {
                    return Err(AppendError::DuplicateBatch(id.to_owned()));
                }
            }
        }
        for (i, a) in appends.iter().enumerate() {
            match &a.expect {
                Expect::Any => {}
                Expect::LastSequence(expected) => {
                    if i > 0 {
                        return Err(AppendError::Refused(
                            "only the first event of a batch may expect a last sequence".into(),
                        ));
                    }
                    if *expected != next {
                        return Err(AppendError::Conflict {
                            expected: *expected,
                            actual: next,
                        });
                    }
                }
                Expect::LastSubjectSequence { filter, seq } => {
                    if appends[..i]
                        .iter()
                        .any(|b| subject_matches(filter, &b.subject))
                    {
                        return Err(AppendError::Refused(format!(
                            "an earlier event of the batch writes to {filter}, so its last sequence cannot be expected"
                        )));
                    }
                    let actual = self
                        .subjects
                        .iter()
                        .chain(overlay.subjects.iter())
                        .filter(|(s, _)| subject_matches(filter, s))
                        .map(|(_, &seq)| seq)
                        .max()
                        .unwrap_or(0);
                    if actual != *seq {
                        return Err(AppendError::Conflict {
                            expected: *seq,
                            actual,
                        });
                    }
                }
            }
        }
        Ok(Checked::Fresh)
    }
}

enum Checked {
    Fresh,
    Duplicate(u64),
}

/// Consecutive events under one key `b<first seq>`: `u32 length, record` for each (see
/// [`encode`]).
struct Block {
    first: u64,
    count: usize,
    bytes: Vec<u8>,
    /// Changed since it was last written.
    dirty: bool,
}

impl Block {
    fn starting(first: u64) -> Self {
        Block {
            first,
            count: 0,
            bytes: Vec::new(),
            dirty: false,
        }
    }

    /// The block stored at `b<first>`.
    fn stored(first: u64, bytes: &[u8]) -> Result<Self, LogError> {
        let count = records(first, bytes)?.len();
        if count == 0 {
            return Err(LogError::Corrupt {
                seq: first,
                reason: "an empty block".into(),
            });
        }
        Ok(Block {
            first,
            count,
            bytes: bytes.to_vec(),
            dirty: false,
        })
    }

    /// Adds the record of event `seq`. When the block is full, or `seq` does not follow it,
    /// the block is written to `batch` first and the record starts the next one; says whether
    /// it did.
    fn add(&mut self, seq: u64, record: &[u8], batch: &mut sled::Batch) -> bool {
        let next = self.count > 0
            && (seq != self.first + self.count as u64
                || self.count >= BLOCK_EVENTS
                || self.bytes.len() + 4 + record.len() > BLOCK_BYTES);
        if next {
            std::mem::replace(self, Block::starting(seq)).write_to(batch);
        } else if self.count == 0 {
            self.first = seq;
        }
        self.bytes
            .extend_from_slice(&(record.len() as u32).to_be_bytes());
        self.bytes.extend_from_slice(record);
        self.count += 1;
        self.dirty = true;
        next
    }

    /// Adds the block to `batch` if it changed since it was last written.
    fn write_to(&mut self, batch: &mut sled::Batch) {
        if self.dirty && self.count > 0 {
            batch.insert(key(b'b', self.first).to_vec(), self.bytes.clone());
        }
        self.dirty = false;
    }
}

/// The records of the block starting at `first`, with their sequences.
fn records(first: u64, mut v: &[u8]) -> Result<Vec<(u64, &[u8])>, LogError> {
    let mut out = Vec::new();
    while !v.is_empty() {
        let seq = first + out.len() as u64;
        let truncated = || LogError::Corrupt {
            seq,
            reason: "block truncated".into(),
        };
        let len = v
            .get(..4)
            .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize)
            .ok_or_else(truncated)?;
        let record = v.get(4..4 + len).ok_or_else(truncated)?;
        out.push((seq, record));
        v = &v[4 + len..];
    }
    Ok(out)
}

/// Opens the log's tree in `dir`, putting a conversion a crash interrupted in place first and
/// clearing what conversions left behind once the directory's lock is held (so no conversion
/// is under way elsewhere).
fn open_tree(dir: &Path) -> Result<(sled::Db, sled::Tree), OpenError> {
    let storage = |e: std::io::Error| OpenError::Storage {
        dir: dir.to_owned(),
        reason: e.to_string(),
    };
    put_converted_in_place(dir).map_err(storage)?;
    let db = open_sled(sled::Config::new().path(dir)).map_err(|e| open_error(dir, e))?;
    clear_conversion_leftovers(dir).map_err(storage)?;
    let tree = db.open_tree("log").map_err(|e| open_error(dir, e))?;
    Ok((db, tree))
}

/// The page cache each sled database of this process gets by default (the log's and the
/// projection's): sled's own 1 GiB, for the commands that fold a whole log. `serve` sets a
/// smaller one ([`set_cache_bytes`]).
pub const DEFAULT_CACHE_BYTES: u64 = 1024 * 1024 * 1024;

static CACHE_BYTES: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(DEFAULT_CACHE_BYTES);

/// Sets the page cache of every sled database this process opens from now on.
pub fn set_cache_bytes(bytes: u64) {
    CACHE_BYTES.store(bytes, std::sync::atomic::Ordering::Relaxed);
}

static BACKGROUND_COMPACTION: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(true);

/// Whether the sled databases this process opens from now on run sled's background thread
/// (on unless turned off). Every half second it writes out and syncs what was written, which
/// this product does not need: the log syncs each group commit before acknowledging it, and
/// the projection syncs each checkpoint, refolding what came after from the log. It also
/// compacts: it reads back every page of a segment that is mostly garbage and writes it anew.
/// After an import or a rebuild most segments are, and the pages it reads stay in memory
/// beyond the page cache. With it off, space left by rewritten pages is reused only once a
/// whole segment is garbage, so the files grow more: a long-running server (`serve`) turns it
/// off to keep its memory bounded by its live work; the other commands keep it. On the
/// 10-million-event ledger, with 50,000 submissions waiting: 207–209 MB resident with it off,
/// 241–283 MB with it on; in about 180,000 submissions the projection's file grew 86 MB
/// against 55 MB, the log's alike (see BENCHMARKS.md).
pub fn set_background_compaction(on: bool) {
    BACKGROUND_COMPACTION.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Opens the sled database in `dir` once more and closes it. sled (0.34) records where its own
/// log stands only when it opens a database, and replays everything written since on the next
/// open: after writing much at once (an import, a projection rebuild), this pays that replay
/// now, so the server's next start does not (0.9 s to 0.1 s for a 3-million-event rebuild).
pub fn settle(dir: &Path) -> sled::Result<()> {
    open_sled(sled::Config::new().path(dir)).map(drop)
}

/// Opens a sled database with this process's page cache and background compaction, waiting up
/// to five seconds for the lock of a handle this process just dropped: sled's flusher thread
/// lets go of the directory only when it next wakes (every 500 ms, later under load).
pub fn open_sled(config: sled::Config) -> sled::Result<sled::Db> {
    let mut config = config.cache_capacity(CACHE_BYTES.load(std::sync::atomic::Ordering::Relaxed));
    if !BACKGROUND_COMPACTION.load(std::sync::atomic::Ordering::Relaxed) {
        config = config.flush_every_ms(None);
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        match config.open() {
            Err(e) if is_locked(&e) && std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            other => return other,
        }
    }
}

/// Whether sled could not open a directory because another handle holds its lock. sled says so
/// only in words (an `Other` I/O error), so this is the one place that reads them.
fn is_locked(e: &sled::Error) -> bool {
    matches!(e, sled::Error::Io(io) if io.to_string().contains("could not acquire lock"))
}

fn open_error(dir: &Path, e: sled::Error) -> OpenError {
    let reason = e.to_string();
    if is_locked(&e) {
        OpenError::Locked(dir.to_owned())
    } else if matches!(e, sled::Error::Corruption { .. }) {
        OpenError::Corrupt {
            dir: dir.to_owned(),
            reason,
        }
    } else {
        OpenError::Storage {
            dir: dir.to_owned(),
            reason,
        }
    }
}

fn key(space: u8, seq: u64) -> [u8; 9] {
    let mut k = [space; 9];
    k[1..].copy_from_slice(&seq.to_be_bytes());
    k
}

fn prefixed(space: u8, rest: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(rest.len() + 1);
    k.push(space);
    k.extend_from_slice(rest);
    k
}

fn seq_of_key(k: &[u8]) -> Option<u64> {
    (k.len() == 9).then(|| u64_of(&k[1..])).flatten()
}

fn u64_of(v: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(v.try_into().ok()?))
}

/// `u16 subject length, subject, u16 key length (0xFFFF: none), key, payload`.
fn encode(a: &Append) -> Vec<u8> {
    let id = a.msg_id.as_deref();
    let mut v = Vec::with_capacity(4 + a.subject.len() + id.map_or(0, str::len) + a.payload.len());
    v.extend_from_slice(&(a.subject.len() as u16).to_be_bytes());
    v.extend_from_slice(a.subject.as_bytes());
    match id {
        Some(id) => {
            v.extend_from_slice(&(id.len() as u16).to_be_bytes());
            v.extend_from_slice(id.as_bytes());
        }
        None => v.extend_from_slice(&u16::MAX.to_be_bytes()),
    }
    v.extend_from_slice(&a.payload);
    v
}

fn decode(seq: u64, v: &[u8]) -> Result<Stored, LogError> {
    let corrupt = |reason: &str| LogError::Corrupt {
        seq,
        reason: reason.to_owned(),
    };
    let take_len = |at: usize| -> Result<u16, LogError> {
        v.get(at..at + 2)
            .map(|b| u16::from_be_bytes([b[0], b[1]]))
            .ok_or_else(|| corrupt("record truncated"))
    };
    let subject_len = usize::from(take_len(0)?);
    let subject = v
        .get(2..2 + subject_len)
        .and_then(|b| std::str::from_utf8(b).ok())
        .ok_or_else(|| corrupt("bad subject"))?
        .to_owned();
    let mut at = 2 + subject_len;
    let id_len = take_len(at)?;
    at += 2;
    let msg_id = if id_len == u16::MAX {
        None
    } else {
        let id = v
            .get(at..at + usize::from(id_len))
            .and_then(|b| std::str::from_utf8(b).ok())
            .ok_or_else(|| corrupt("bad idempotency key"))?;
        at += usize::from(id_len);
        Some(id.to_owned())
    };
    Ok(Stored {
        seq,
        subject,
        msg_id,
        payload: Bytes::copy_from_slice(&v[at..]),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_reopens_right_after_its_handle_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        for i in 0..20u64 {
            let db = open_sled(sled::Config::new().path(dir.path())).unwrap();
            db.insert(i.to_be_bytes(), &[1u8][..]).unwrap();
            db.flush().unwrap();
            drop(db);
        }
        let db = open_sled(sled::Config::new().path(dir.path())).unwrap();
        assert_eq!(db.len(), 20);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_flush_acknowledges_nothing_and_stops_the_log() {
        let dir = tempfile::tempdir().unwrap();
        let log = EmbeddedLog::open(dir.path()).unwrap();
        let append = |key: &str| Append::new("fairledger.ledger.test", "x").with_msg_id(key);
        let first = log.append(append("a")).await.unwrap();
        assert_eq!((first.seq, first.duplicate), (1, false));
        log.fail_flushes
            .store(true, std::sync::atomic::Ordering::SeqCst);
        // Written but not known to be durable: unacknowledged, and so is a retry of it sent
        // alongside (its original is the append whose flush failed), never a duplicate's Ok.
        let (lost, retry) = tokio::join!(log.append(append("b")), log.append(append("b")));
        assert!(
            matches!(lost, Err(AppendError::Unacknowledged(_))),
            "{lost:?}"
        );
        assert!(
            matches!(
                retry,
                Err(AppendError::Unacknowledged(_) | AppendError::Unavailable(_))
            ),
            "{retry:?}"
        );
        // ... and from then on the log refuses appends, saying why.
        let refused = log.append(append("c")).await;
        match refused {
            Err(AppendError::Unavailable(reason)) => {
                assert!(reason.contains("writing to disk failed"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
        // Readers still see only what was acknowledged.
        assert_eq!(log.last_seq().await.unwrap(), 1);
        assert_eq!(log.read(1, 10).await.unwrap().len(), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn another_holder_is_reported_as_such() {
        let dir = tempfile::tempdir().unwrap();
        let _held = EmbeddedLog::open(dir.path()).unwrap();
        let err = EmbeddedLog::open(dir.path()).err().unwrap();
        assert!(matches!(err, OpenError::Locked(_)), "{err}");
        assert!(err.to_string().contains("another process"), "{err}");
    }

    fn keys_in(log: &EmbeddedLog, space: u8) -> usize {
        log.tree.scan_prefix([space]).count()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn events_fill_blocks_and_read_back_from_anywhere() {
        let dir = tempfile::tempdir().unwrap();
        let payload = |i: u64| {
            format!(
                "{{\"n\":{i},\"pad\":\"{}\"}}",
                "x".repeat((i % 300) as usize)
            )
        };
        let mut written = 0u64;
        {
            let log = EmbeddedLog::open(dir.path()).unwrap();
            // Singles and batches, as writers send them.
            while written < 400 {
                let n = [1, 7, 1, 33, 2][(written % 5) as usize];
                let appends = (written..written + n)
                    .map(|i| Append::new("fairledger.ledger.test", payload(i + 1)))
                    .collect();
                log.append_batch(appends).await.unwrap();
                written += n;
            }
            let blocks = keys_in(&log, b'b');
            assert!(
                blocks * 8 < written as usize,
                "{blocks} blocks for {written} events"
            );
            assert_eq!(keys_in(&log, b'e'), 0);
        }
        let log = EmbeddedLog::open(dir.path()).unwrap();
        assert_eq!(log.last_seq().await.unwrap(), written);
        let before = keys_in(&log, b'b');
        log.append(Append::new("fairledger.ledger.test", payload(written + 1)))
            .await
            .unwrap();
        written += 1;
        assert!(
            keys_in(&log, b'b') <= before + 1,
            "the last block goes on filling after a restart"
        );
        for from in 1..=written {
            let max = (from % 50 + 1) as usize;
            let read = log.read(from, max).await.unwrap();
            let expected: Vec<u64> = (from..=written).take(max).collect();
            assert_eq!(
                read.iter().map(|e| e.seq).collect::<Vec<_>>(),
                expected,
                "read({from}, {max})"
            );
            for e in &read {
                assert_eq!(e.payload, payload(e.seq).into_bytes());
            }
        }
        assert!(log.read(written + 1, 10).await.unwrap().is_empty());
    }

    /// Writes `appends` into `dir` as the log was kept before blocks: e<seq>, d<key>,
    /// s<subject>.
    fn write_per_event_keys(dir: &Path, appends: &[Append]) {
        let db = open_sled(sled::Config::new().path(dir)).unwrap();
        let tree = db.open_tree("log").unwrap();
        for (i, a) in appends.iter().enumerate() {
            let seq = i as u64 + 1;
            tree.insert(key(b'e', seq), encode(a)).unwrap();
            tree.insert(
                prefixed(b'd', a.msg_id.as_deref().unwrap().as_bytes()),
                &seq.to_be_bytes(),
            )
            .unwrap();
            tree.insert(prefixed(b's', a.subject.as_bytes()), &seq.to_be_bytes())
                .unwrap();
        }
        db.flush().unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_conversion_cut_short_is_finished_or_done_again() {
        let parent = tempfile::tempdir().unwrap();
        let appends: Vec<Append> = (1..=50u64)
            .map(|i| Append::new("fairledger.ledger.s", format!("{i}")).with_msg_id(format!("{i}")))
            .collect();
        // Cut short while the new directory was being written: the old one stands.
        let dir = parent.path().join("a");
        write_per_event_keys(&dir, &appends);
        std::fs::create_dir_all(converting(&dir)).unwrap();
        std::fs::write(converting(&dir).join("db"), b"half").unwrap();
        let log = EmbeddedLog::open(&dir).unwrap();
        assert_eq!(log.read(1, 100).await.unwrap().len(), 50);
        assert!(!converting(&dir).exists());
        drop(log);
        // Cut short between the two renames: the converted log takes its place.
        let dir = parent.path().join("b");
        write_per_event_keys(&dir, &appends);
        {
            let db = open_sled(sled::Config::new().path(&dir)).unwrap();
            let tree = db.open_tree("log").unwrap();
            convert_per_event_keys(&dir, &tree).unwrap();
        }
        assert!(!dir.exists() && converted(&dir).exists() && converting(&dir).exists());
        let log = EmbeddedLog::open(&dir).unwrap();
        let read = log.read(1, 100).await.unwrap();
        assert_eq!(read.len(), 50);
        assert_eq!(read[49].payload, appends[49].payload);
        assert_eq!(keys_in(&log, b'e'), 0);
        assert!(!converting(&dir).exists() && !converted(&dir).exists());
        drop(log);
        // Set aside with no complete copy to take its place: nothing is deleted, and the error
        // says what to do.
        let dir = parent.path().join("c");
        write_per_event_keys(&dir, &appends);
        std::fs::rename(&dir, converted(&dir)).unwrap();
        std::fs::create_dir_all(converting(&dir)).unwrap();
        let err = EmbeddedLog::open(&dir).err().unwrap().to_string();
        assert!(err.contains("move") && err.contains("back"), "{err}");
        assert!(converted(&dir).join("db").exists());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_log_with_one_key_per_event_is_converted_when_opened() {
        let dir = tempfile::tempdir().unwrap();
        let dir = &dir.path().join("log");
        let appends: Vec<Append> = (1..=3000u64)
            .map(|i| {
                Append::new(
                    format!("fairledger.ledger.s{}", i % 3),
                    format!("{{\"n\":{i}}}"),
                )
                .with_msg_id(format!("id{i}"))
            })
            .collect();
        write_per_event_keys(dir, &appends);
        std::fs::write(dir.join(HIGH_WATER), format!("{:020}\n", 3000)).unwrap();
        let log = EmbeddedLog::open(dir).unwrap();
        assert_eq!(log.last_seq().await.unwrap(), 3000);
        assert!(!converting(dir).exists() && !converted(dir).exists());
        assert!(
            dir.join(HIGH_WATER).exists(),
            "the high-water mark came along"
        );
        assert_eq!((keys_in(&log, b'e'), keys_in(&log, b'd')), (0, 0));
        let read = log.read(1, 5000).await.unwrap();
        assert_eq!(read.len(), 3000);
        for (e, a) in read.iter().zip(&appends) {
            assert_eq!(
                (&e.subject, &e.msg_id, &e.payload),
                (&a.subject, &a.msg_id, &a.payload)
            );
        }
        let next = log
            .append(Append::new("fairledger.ledger.s0", "{}").with_msg_id("new"))
            .await
            .unwrap();
        assert_eq!(next.seq, 3001);
        // The subjects' last sequences came through.
        let fenced = log
            .append(Append::new("fairledger.ledger.s1", "{}").expecting(
                Expect::LastSubjectSequence {
                    filter: "fairledger.ledger.s1".into(),
                    seq: 2998,
                },
            ))
            .await
            .unwrap();
        assert_eq!(fenced.seq, 3002);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn idempotency_keys_are_remembered_for_a_window_then_forgotten() {
        let dir = tempfile::tempdir().unwrap();
        let window = std::time::Duration::from_secs(1);
        let append = |key: &str| Append::new("fairledger.ledger.test", "x").with_msg_id(key);
        {
            let log = EmbeddedLog::open_with_window(dir.path(), window).unwrap();
            assert_eq!(log.append(append("a")).await.unwrap().seq, 1);
        }
        // Remembered across a restart, within the window.
        let log = EmbeddedLog::open_with_window(dir.path(), window).unwrap();
        let again = log.append(append("a")).await.unwrap();
        assert_eq!((again.seq, again.duplicate), (1, true));
        // Two windows on, it is forgotten, and so are its keys on disk.
        tokio::time::sleep(std::time::Duration::from_millis(2_100)).await;
        let later = log.append(append("a")).await.unwrap();
        assert_eq!((later.seq, later.duplicate), (2, false));
        assert_eq!(
            keys_in(&log, b'k'),
            1,
            "the expired window's key is deleted"
        );
        let retry = log.append(append("a")).await.unwrap();
        assert_eq!((retry.seq, retry.duplicate), (2, true));
    }
}
