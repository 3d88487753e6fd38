//! The projector: folds the ledger log into a sled projection, exactly once.
//!
//! The projection is one sled tree of rows in these key spaces:
//!
//! - `m/…` meta: the fold settings, the last applied sequence and the counts of applied, rejected, duplicate and
//!   malformed events;
//! - `w/<id>` one row per workload (phase, allocation, placement, protection, name, runs), in
//!   postcard; ids are UUIDv7 (the API's, the simulator's), so id order is submission order
//!   and listings read it backwards;
//! - `x/<first id>` the same rows of ended workloads, a few dozen to a key (the `pack` module:
//!   sled's memory grows with its keys, and ended workloads are most of history);
//! - `a/<path>` one row per allocation (weight, owed and delivered GPU-hours, preemptions);
//! - `r/<seq>` one row per event the fold rejected or could not decode;
//! - `i/<key>` the workload the first submission with an idempotency key created, and that
//!   submission's sequence;
//! - `k/<granularity><period start><allocation>` the kept figures of every closed hour, day,
//!   ISO week and month, per allocation and for the cluster ([`ledger::book`]), written once
//!   when the period closes and read by [`Kept`] without holding up the fold.
//!
//! The folded state lends its ended workloads (their rows) and used idempotency keys
//! (`i/`) to the projection ([`ledger::Archive`]) once each batch is written, so what it holds
//! in memory, and checkpoints, is bounded by live work rather than by history.
//!
//! The checkpoint — the whole folded [`ledger::State`], its [`Book`] and the sequence they are
//! at — lives in a tree of its own: in the same tree, the few keys beside it that every batch
//! writes shared its sled page, and sled rewrote the whole multi-megabyte page with them (it
//! took half the server's CPU under load). A copy of the state is taken just after the batch it
//! follows and written on a thread of its own while the fold goes on (one at a time), so after a
//! crash before it lands the older checkpoint stands, and the refold from it is longer.
//!
//! Every batch of events is written as one atomic sled batch together with the new last
//! sequence, so after a crash at any point the projection is exactly the fold of a prefix of the
//! log, and projecting resumes after that prefix: nothing skipped, nothing applied twice. The
//! in-memory state resumes from the checkpoint and refolds the few events after it.
//!
//! Catching up with what the log already holds (a rebuild, a restart), batches are larger and
//! written to sled by a thread of their own while the fold goes on (the `behind` module); a
//! projection interrupted meanwhile is still the fold of a prefix of the log.
//!
//! The digest is a SHA-256 over every row, in key order (workload rows in id order, packed or
//! not): two projections of the same log prefix have the same digest however the work was split
//! into batches, which is how tests prove the incrementally maintained projection equals a full
//! replay.

mod behind;
mod checkpoint;
mod follow;
mod open;
mod pack;
pub mod verify;
mod write;

use checkpoint::read_checkpoint;
pub(crate) use checkpoint::refold;
pub use follow::{follow, replay};

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use eventlog::{EventLog, LogError, Stored};
use futures::{FutureExt, StreamExt};
use ledger::book::{Book, Granularity, Row};
use ledger::state::{Outcome, Phase, State, StateConfig};
use ledger::{Envelope, Event, WorkloadId};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Events folded per sled batch when following the log.
pub const BATCH: usize = 1024;
/// Events folded per sled batch when catching up, with nobody waiting: a workload submitted
/// and ended within one batch is written once, straight into its pack (about a day of a busy
/// cluster's events).
pub const CATCH_UP_BATCH: usize = 64 * BATCH;
/// A checkpoint is written after this many events by default.
pub const CHECKPOINT_EVERY: u64 = 100_000;

const LAST_SEQ: &[u8] = b"m/last_seq";
const CONFIG: &[u8] = b"m/config";
/// The rows' format, and the fold's: a projection built with another is rebuilt from the log
/// (21: principals name the log's root of authority; 19: quotas: the fold counts waiting work by submitter and the GPUs waiting in each leaf,
/// and allocations and principals carry their caps on it; 18: what preemptions cost among the kept figures, the log's head in the book and its rows,
/// and the settings folded from the log; 17: defragmentation among the kept preemptions; 16: the fold indexes borrowed placements by
/// term and nodes with work leaving; 15: no index of submissions (14 had one); 14: workload rows
/// carry their name, run time and last nodes; 13: borrowed placements, and reclaims among the kept preemptions; 12: idempotency keys have
/// rows; 11: version-1 events are folded by the names rules of their day again).
const FORMAT: u32 = 21;
const STATS: &[u8] = b"m/stats";
const CHECKPOINT_SEQ: &[u8] = b"seq";
const CHECKPOINT_STATE: &[u8] = b"state";
const CHECKPOINT_BOOK: &[u8] = b"book";

/// Counts of what the projector did with the events it read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// Events the fold applied.
    pub applied: u64,
    /// Events the fold rejected as invalid in the state they met.
    pub rejected: u64,
    /// Submissions whose idempotency key was already used.
    pub duplicates: u64,
    /// Events that did not decode, or of a schema version this build does not know.
    pub malformed: u64,
}

impl Stats {
    /// Every event read.
    pub fn total(&self) -> u64 {
        self.applied + self.rejected + self.duplicates + self.malformed
    }
}

/// GPUs of one node held by a workload.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacedRow {
    /// The node's name.
    pub node: String,
    /// GPU indices on the node.
    pub gpus: Vec<u32>,
}

/// What the projection knows of one workload.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkloadRow {
    /// Its id.
    pub id: WorkloadId,
    /// Allocation path; `None` for unallocated work.
    pub allocation: Option<String>,
    /// Who submitted it: the actor of its submission (`user:alice`).
    pub user: String,
    /// Where it is in its life; stored and answered by name (`pending`, `running`, `stopped`,
    /// `finished` or `cancelled`).
    #[serde(with = "phase_name")]
    pub phase: Phase,
    /// GPUs per node.
    pub gpus_per_node: u32,
    /// Nodes in the gang.
    pub nodes: u32,
    /// Priority within the allocation.
    pub priority: i32,
    /// Sequence of the submission.
    pub submit_seq: u64,
    /// Submission time.
    pub submitted_at_ms: u64,
    /// Start of the current or last run.
    pub started_at_ms: Option<u64>,
    /// End of the current run's protection.
    pub protected_until_ms: Option<u64>,
    /// While the current run is on GPUs borrowed from a reservation: for which workload, and
    /// from when the reservation may take them back.
    pub borrowed: Option<ledger::event::Borrowed>,
    /// GPUs held while running.
    pub placement: Vec<PlacedRow>,
    /// A preemption was requested and is in its grace period.
    pub preempting: bool,
    /// Runs started.
    pub starts: u32,
    /// Work done in completed runs.
    pub work_done_ms: u64,
    /// Sequence of the last event about it that the fold applied.
    pub last_seq: u64,
    /// When it finished or was cancelled.
    pub ended_at_ms: Option<u64>,
    /// Sequences of every event about it that the fold applied, oldest first.
    pub history: Vec<u64>,
    /// Sequences of the events about it that the fold refused, oldest first.
    #[serde(default)]
    pub rejected: Vec<u64>,
    /// How its last run ended, once it finished: 0 succeeded, anything else failed.
    #[serde(default)]
    pub exit_code: Option<i32>,
    /// The signal that ended its last run, if one did.
    #[serde(default)]
    pub signal: Option<i32>,
    /// Why it failed without running its command (its node could not launch it), if so.
    #[serde(default)]
    pub error: Option<String>,
    /// The name it was submitted with.
    #[serde(default)]
    pub name: Option<String>,
    /// Time on GPUs in its completed runs (the current run's is `now - started_at_ms`).
    #[serde(default)]
    pub run_ms: u64,
    /// The nodes of its current or last run, first the one whose agent keeps the first part.
    #[serde(default)]
    pub ran_on: Vec<String>,
    /// Times it was preempted (for someone else or its hardware; its owner's cancels aside).
    #[serde(default)]
    pub preemptions: u32,
}

impl WorkloadRow {
    /// GPUs it holds while running.
    pub fn gpus(&self) -> u64 {
        u64::from(self.gpus_per_node) * u64::from(self.nodes)
    }

    /// Time on GPUs over all its runs as of `now_ms`, the current one included.
    pub fn run_ms_at(&self, now_ms: u64) -> u64 {
        self.run_ms
            + match (self.phase, self.started_at_ms) {
                (Phase::Running, Some(at)) => now_ms.saturating_sub(at),
                _ => 0,
            }
    }

    /// Its state as `sacct` and `squeue` users read it: `PD` pending, `R` running, `CG` asked
    /// to stop (a preemption or cancel in its grace period), `RQ` stopped and about to be
    /// requeued, `CD` finished with exit code 0, `F` finished otherwise (an exit code, a signal,
    /// or a node that could not launch it), `CA` cancelled.
    pub fn state_code(&self) -> &'static str {
        match self.phase {
            Phase::Pending => "PD",
            Phase::Running if self.preempting => "CG",
            Phase::Running => "R",
            Phase::Stopped => "RQ",
            Phase::Finished
                if self.exit_code == Some(0) && self.signal.is_none() && self.error.is_none() =>
            {
                "CD"
            }
            Phase::Finished => "F",
            Phase::Cancelled => "CA",
        }
    }

    /// Where its current or last run's output is, under the node agent's `--work-dir` on the
    /// first node of [`WorkloadRow::ran_on`] (the agent's layout: `runs/<id>-<run>/`).
    pub fn output_log(&self) -> Option<String> {
        (self.starts > 0).then(|| format!("runs/{}-{}/output.log", self.id, self.starts))
    }
}

/// What a live workload's row carries from event to event that the folded state does not
/// keep (the sequences of the events about it, its name, its past runs), kept in memory so that
/// its row need not be read back from sled on every event.
#[derive(Clone, Debug, Default)]
struct Trail {
    history: Vec<u64>,
    rejected: Vec<u64>,
    name: Option<String>,
    run_ms: u64,
    ran_on: Vec<String>,
}

impl Trail {
    fn of_row(row: &WorkloadRow) -> Trail {
        Trail {
            history: row.history.clone(),
            rejected: row.rejected.clone(),
            name: row.name.clone(),
            run_ms: row.run_ms,
            ran_on: row.ran_on.clone(),
        }
    }

    fn onto(&self, row: &mut WorkloadRow) {
        row.history.clone_from(&self.history);
        row.rejected.clone_from(&self.rejected);
        row.name.clone_from(&self.name);
        row.run_ms = self.run_ms;
        row.ran_on.clone_from(&self.ran_on);
    }
}

/// What the projection knows of one allocation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AllocationRow {
    /// Path.
    pub path: String,
    /// Weight among siblings.
    pub weight: u32,
    /// Cap on GPUs.
    pub max_gpus: Option<u32>,
    /// Removed (kept for the audit).
    pub removed: bool,
    /// Delivered GPU-milliseconds since the beginning.
    pub delivered_gpu_ms: u64,
    /// Owed GPU-milliseconds since the beginning.
    pub owed_gpu_ms: f64,
    /// Preemptions of its workloads.
    pub preemptions: u64,
    /// Contract violations against its workloads.
    pub contract_violations: u64,
    /// Pending, running and stopped workloads.
    pub live_workloads: u32,
}

/// An event the projection did not apply.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RejectedRow {
    /// The event's kind, when it decoded.
    pub kind: Option<String>,
    /// The rule's code, or `malformed` for what is not an event at all.
    pub code: String,
    /// Why.
    pub message: String,
    /// The event's field at fault when the event is invalid whatever the state
    /// ([`ledger::Rejection::field_in`]): what a request carrying it is answered by, before the
    /// fold or after it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
}

impl RejectedRow {
    /// The row of `event`, rejected by the fold as `r`.
    pub fn of(r: &ledger::Rejection, event: &ledger::Event) -> Self {
        RejectedRow {
            kind: Some(event.kind().to_owned()),
            code: r.code().to_owned(),
            message: r.to_string(),
            field: r.field_in(event).map(str::to_owned),
        }
    }
}

/// Why the projection could not be opened or written.
#[derive(Debug, thiserror::Error)]
pub enum ProjectionError {
    /// sled failed.
    #[error("projection storage in {dir} failed: {reason}; free disk space or delete the directory (it is rebuilt from the log)")]
    Storage {
        /// The directory.
        dir: PathBuf,
        /// sled's message.
        reason: String,
    },
    /// The stored projection does not decode or disagrees with itself.
    #[error("projection in {dir} is corrupt: {reason}")]
    Corrupt {
        /// The directory.
        dir: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The projection was built with other fold settings.
    #[error("projection in {dir} was built with other ledger settings")]
    OtherSettings {
        /// The directory.
        dir: PathBuf,
    },
    /// The projection is ahead of the log: it belongs to another log.
    #[error("projection in {dir} is at sequence {projected} but the log ends at {log}: it belongs to another log")]
    AheadOfLog {
        /// The directory.
        dir: PathBuf,
        /// Where the projection is.
        projected: u64,
        /// Where the log ends.
        log: u64,
    },
    /// A write failed earlier; the in-memory state may be ahead of the stored one.
    #[error("projection in {dir} stopped after a failed write; reopen it")]
    Poisoned {
        /// The directory.
        dir: PathBuf,
    },
    /// The log skipped sequences: the reader lost events.
    #[error("the log reader skipped from sequence {expected} to {got}; resubscribing")]
    Gap {
        /// The sequence due.
        expected: u64,
        /// The sequence that came.
        got: u64,
    },
    /// Reading the log failed.
    #[error(transparent)]
    Log(#[from] LogError),
}

impl ProjectionError {
    /// Whether deleting the projection and rebuilding it from the log cures this.
    pub fn is_rebuildable(&self) -> bool {
        matches!(
            self,
            ProjectionError::Corrupt { .. }
                | ProjectionError::OtherSettings { .. }
                | ProjectionError::AheadOfLog { .. }
        )
    }
}

/// The sled projection and the folded state it was built from.
pub struct Projector {
    dir: PathBuf,
    tree: sled::Tree,
    /// The checkpoint's tree.
    checkpoints: sled::Tree,
    state: State,
    book: Book,
    last_seq: u64,
    stats: Stats,
    checkpoint_every: u64,
    since_checkpoint: u64,
    checkpoint_gap: std::time::Duration,
    last_checkpoint: std::time::Instant,
    last_malformed: Option<(u64, String)>,
    poisoned: bool,
    /// Trails of live workloads, so a row's history need not be read back from sled (a
    /// workload missing here, after a restart, is read once).
    trails: ledger::SteppedMap<WorkloadId, Trail>,
    /// The rows the state lends its ended workloads and keys to.
    archive: std::sync::Arc<RowArchive>,
    /// The checkpoint being written beside the fold, if one is.
    checkpointing: std::sync::Mutex<Option<std::thread::JoinHandle<Result<(), String>>>>,
    /// A checkpoint is due: the fold decided so, the copy is still to be taken.
    checkpoint_due: bool,
    /// Held by listings while they read rows in order; packing takes it when free, never
    /// waiting.
    layout: std::sync::Arc<std::sync::RwLock<()>>,
    /// Ended rows written past the packing position since packing last ran.
    endings: usize,
    /// Live workloads submitted this many events ago no longer hold packing back; `None`: no
    /// packing.
    pack_lag: Option<u64>,
    /// Rows read from packs in the batch being folded (an event about them was refused), with
    /// their packs' keys: they are written back there.
    from_packs: BTreeMap<WorkloadId, Vec<u8>>,
    /// Catching up (folding what the log already holds, with no one waiting), the thread
    /// writing batches behind the fold; packing is not bounded meanwhile.
    writer: Option<behind::Writer>,
    /// Catching up, the keys the batch being folded uses (for the overlay).
    keys: Vec<(Vec<u8>, Vec<u8>)>,
    /// Events folded per batch when catching up.
    catch_up_batch: usize,
}

/// A failed read of the projection's stored rows or checkpoint.
#[derive(Debug)]
pub(crate) enum Fault {
    Storage(sled::Error),
    Corrupt(String),
}

impl Fault {
    pub(crate) fn into_error(self, dir: &Path) -> ProjectionError {
        match self {
            Fault::Storage(e) => ProjectionError::Storage {
                dir: dir.to_owned(),
                reason: e.to_string(),
            },
            Fault::Corrupt(reason) => ProjectionError::Corrupt {
                dir: dir.to_owned(),
                reason,
            },
        }
    }
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fault::Storage(e) => e.fmt(f),
            Fault::Corrupt(reason) => f.write_str(reason),
        }
    }
}

impl From<sled::Error> for Fault {
    fn from(e: sled::Error) -> Self {
        Fault::Storage(e)
    }
}

/// The projection's rows as the folded state's [`ledger::Archive`]: an ended workload is its
/// row in a final phase (single or packed), a used key its `i/` row. A read that fails is remembered, and the
/// batch folded meanwhile is not written (the fold cannot wait on an error); a reader's failed
/// read between folds only makes its answer a "not found".
struct RowArchive {
    tree: sled::Tree,
    failed: std::sync::atomic::AtomicBool,
    /// Where packing has reached: rows past it are not looked for in packs.
    through: std::sync::Arc<std::sync::Mutex<Option<WorkloadId>>>,
    /// What the batch being written behind a catching-up fold holds: read before the tree.
    overlay: std::sync::Mutex<pack::Overlay>,
    /// The greatest id with a row: ids are mostly submitted in order, and a new one past it is
    /// not looked for in the tree.
    newest: std::sync::Arc<std::sync::Mutex<Option<WorkloadId>>>,
}

impl RowArchive {
    fn get(&self, key: &[u8]) -> Option<sled::IVec> {
        if let Some(v) = self.overlay().keys.get(key) {
            return Some(v.as_slice().into());
        }
        self.tree.get(key).unwrap_or_else(|e| {
            tracing::error!(error = %e, "reading the projection's archive");
            self.failed.store(true, std::sync::atomic::Ordering::SeqCst);
            None
        })
    }

    fn overlay(&self) -> std::sync::MutexGuard<'_, pack::Overlay> {
        self.overlay.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn newest(&self) -> Option<WorkloadId> {
        *self.newest.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Notes that workload `id` has a row (or is about to).
    fn raise_newest(&self, id: WorkloadId) {
        let mut newest = self.newest.lock().unwrap_or_else(|e| e.into_inner());
        if newest.is_none_or(|n| id > n) {
            *newest = Some(id);
        }
    }

    fn through(&self) -> Option<WorkloadId> {
        *self.through.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Workload `id`'s stored row and where it is.
    fn find(&self, id: WorkloadId) -> Result<Option<(Vec<u8>, pack::Place)>, Fault> {
        if let Some(found) = self.overlay().rows.get(&id) {
            return Ok(Some(found.clone()));
        }
        if self.newest().is_none_or(|newest| id > newest) {
            return Ok(None);
        }
        pack::find(&self.tree, id, Some(self.through()))
    }
}

impl ledger::Archive for RowArchive {
    fn ended(&self, id: WorkloadId, as_of: u64) -> Option<Phase> {
        let found = self.find(id).unwrap_or_else(|e| {
            tracing::error!(error = ?e, "reading the projection's archive");
            self.failed.store(true, std::sync::atomic::Ordering::SeqCst);
            None
        });
        let row: WorkloadRow = postcard::from_bytes(&found?.0).ok()?;
        if row.ended_at_ms.is_none() || row.last_seq > as_of {
            return None;
        }
        Some(row.phase)
    }

    fn idempotent(&self, key: &str, as_of: u64) -> Option<WorkloadId> {
        let (id, seq): (WorkloadId, u64) =
            postcard::from_bytes(&self.get(&idempotency_key(key))?).ok()?;
        (seq <= as_of).then_some(id)
    }
}

impl Projector {
    /// Folds `n` events per batch when catching up ([`CATCH_UP_BATCH`]). For tests that cross
    /// many batches with few events.
    #[doc(hidden)]
    pub fn catch_up_batch(mut self, n: usize) -> Self {
        self.catch_up_batch = n.max(1);
        self
    }

    /// Packs ended workload rows with live workloads submitted more than `lag` events ago no
    /// longer holding packing back (`None`: no packing). For tests of how rows are stored.
    #[doc(hidden)]
    pub fn pack_lag(mut self, lag: Option<u64>) -> Self {
        self.pack_lag = lag;
        self
    }

    /// How many workload rows are stored one to a key, and how many packs hold the others.
    /// For tests of how rows are stored.
    #[doc(hidden)]
    pub fn stored_rows(&self) -> Result<(usize, usize), ProjectionError> {
        pack::count(&self.tree).map_err(|e| self.fault(e))
    }

    /// Writes a checkpoint every `n` events (at least 1).
    pub fn checkpoint_every(mut self, n: u64) -> Self {
        self.checkpoint_every = n.max(1);
        self
    }

    /// Writes a checkpoint no sooner than `gap` after the last one (or the opening), however
    /// many events arrive. The fold waits only while the state is copied for a checkpoint (its
    /// serialization and writing go on beside it), but the copy and the writing still take
    /// time and CPU from it; under a heavy stream of events a gap keeps them rare, at the price
    /// of more events to refold after a restart.
    pub fn checkpoint_at_most_every(mut self, gap: std::time::Duration) -> Self {
        self.checkpoint_gap = gap;
        self
    }

    /// The sequence of the stored checkpoint, if one was written (after the one being written,
    /// if any).
    pub fn checkpoint_seq(&self) -> Result<Option<u64>, ProjectionError> {
        self.settle_checkpoint(true)?;
        match self
            .checkpoints
            .get(CHECKPOINT_SEQ)
            .map_err(|e| self.storage(e))?
        {
            None => Ok(None),
            Some(v) => u64_of(&v)
                .map(Some)
                .ok_or_else(|| self.corrupt("bad checkpoint sequence")),
        }
    }

    /// The last applied sequence.
    pub fn last_seq(&self) -> u64 {
        self.last_seq
    }

    /// The folded state (what the scheduler decides on).
    pub fn state(&self) -> &State {
        &self.state
    }

    /// The kept figures of the periods still open (the closed ones are in [`Projector::kept`]).
    pub fn book(&self) -> &Book {
        &self.book
    }

    /// A reader of the kept rows that needs no lock on the projector.
    pub fn kept(&self) -> Kept {
        Kept {
            tree: self.tree.clone(),
            dir: self.dir.clone(),
            layout: self.layout.clone(),
        }
    }

    /// What happened to the events read.
    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// The last event that did not decode since this projector was opened: its sequence and
    /// why.
    pub fn last_malformed(&self) -> Option<&(u64, String)> {
        self.last_malformed.as_ref()
    }

    /// One workload's row.
    pub fn workload(&self, id: WorkloadId) -> Result<Option<WorkloadRow>, ProjectionError> {
        Ok(self.stored_row(id)?.map(|(row, _)| row))
    }

    /// One workload's stored row and where it is.
    fn stored_row(
        &self,
        id: WorkloadId,
    ) -> Result<Option<(WorkloadRow, pack::Place)>, ProjectionError> {
        let Some((bytes, place)) = self.archive.find(id).map_err(|e| self.fault(e))? else {
            return Ok(None);
        };
        postcard::from_bytes(&bytes)
            .map(|row| Some((row, place)))
            .map_err(|e| self.corrupt(&format!("workload row {id}: {e}")))
    }

    /// One allocation's row.
    pub fn allocation(&self, path: &str) -> Result<Option<AllocationRow>, ProjectionError> {
        self.get_json(&prefixed(b"a/", path.as_bytes()))
    }

    /// Why the event at `seq` was not applied, if it was not.
    pub fn rejection(&self, seq: u64) -> Result<Option<RejectedRow>, ProjectionError> {
        self.get_json(&rejection_key(seq))
    }

    /// Every event not applied, by sequence.
    pub fn rejected(&self) -> Result<Vec<(u64, RejectedRow)>, ProjectionError> {
        let mut out = Vec::new();
        for entry in self.tree.scan_prefix(b"r/") {
            let (k, v) = entry.map_err(|e| self.storage(e))?;
            let seq = u64_of(&k[2..]).ok_or_else(|| self.corrupt("bad rejection key"))?;
            let row = serde_json::from_slice(&v).map_err(|_| self.corrupt("bad rejection row"))?;
            out.push((seq, row));
        }
        Ok(out)
    }

    fn get_json<T: for<'de> Deserialize<'de>>(
        &self,
        key: &[u8],
    ) -> Result<Option<T>, ProjectionError> {
        match self.tree.get(key).map_err(|e| self.storage(e))? {
            None => Ok(None),
            Some(v) => serde_json::from_slice(&v)
                .map(Some)
                .map_err(|e| self.corrupt(&format!("row {key:?}: {e}"))),
        }
    }

    /// SHA-256 over every row (the checkpoint is not one), in key order, as hex: workload rows
    /// as `w/<id>` in id order whether packed or not, and nothing of where they are stored.
    pub fn digest(&self) -> Result<String, ProjectionError> {
        fn add(hash: &mut Sha256, k: &[u8], v: &[u8]) {
            hash.update((k.len() as u64).to_be_bytes());
            hash.update(k);
            hash.update((v.len() as u64).to_be_bytes());
            hash.update(v);
        }
        let mut hash = Sha256::new();
        for entry in self.tree.range(..pack::SINGLE) {
            let (k, v) = entry.map_err(|e| self.storage(e))?;
            if *k != *pack::THROUGH {
                add(&mut hash, &k, &v);
            }
        }
        for row in pack::Rows::ascending(&self.tree) {
            let (id, v) = row.map_err(|e| self.fault(e))?;
            add(&mut hash, &pack::single_key(id), &v);
        }
        for entry in self.tree.range(pack::AFTER_ROWS..) {
            let (k, v) = entry.map_err(|e| self.storage(e))?;
            add(&mut hash, &k, &v);
        }
        Ok(hash.finalize().iter().map(|b| format!("{b:02x}")).collect())
    }

    /// Reads and folds up to `max` events after the last applied one, without waiting for
    /// more. Returns how many were folded (0 when caught up).
    pub async fn project_next<L: EventLog>(
        &mut self,
        log: &L,
        max: usize,
    ) -> Result<usize, ProjectionError> {
        let events = log.read(self.last_seq + 1, max).await?;
        self.apply(&events)
    }

    /// Folds everything the log holds now, in batches of [`CATCH_UP_BATCH`] written behind the
    /// fold (the `behind` module), from one subscription. Returns the last applied sequence.
    pub async fn catch_up<L: EventLog>(&mut self, log: &L) -> Result<u64, ProjectionError> {
        // A subscription that ends early (a reconnection, a reader that lost its place) is
        // taken up again after what is folded, a few times, before the error stands.
        let mut tries = 0;
        loop {
            match self.catch_up_once(log).await {
                Err(ProjectionError::Log(LogError::Unavailable(e))) if tries < 5 => {
                    tries += 1;
                    tracing::warn!(error = %e, "catching up: reading the log again");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                other => return other,
            }
        }
    }

    async fn catch_up_once<L: EventLog>(&mut self, log: &L) -> Result<u64, ProjectionError> {
        let target = log.last_seq().await?;
        if self.last_seq >= target {
            return Ok(self.last_seq);
        }
        // Reading (decoding the wire) and folding (writing sled) overlap: a task reads batches
        // ahead while this one folds.
        let mut events = log.subscribe(self.last_seq + 1).await?;
        self.writer = Some(
            behind::Writer::start(self.tree.clone(), self.last_seq).map_err(|e| {
                ProjectionError::Storage {
                    dir: self.dir.clone(),
                    reason: format!("cannot start the projection's writer: {e}"),
                }
            })?,
        );
        // One batch waiting while one is folded: each may hold tens of megabytes.
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Result<Vec<Decoded>, LogError>>(1);
        let size = self.catch_up_batch;
        let reader = tokio::spawn(async move {
            let mut batch = Vec::with_capacity(size);
            while let Some(event) = events.next().await {
                let event = match event {
                    Ok(e) => e,
                    Err(e) => {
                        let _ = tx.send(Err(e)).await;
                        return;
                    }
                };
                let done = event.seq >= target;
                batch.push(Decoded::from(&event));
                if batch.len() >= size || done {
                    let full = std::mem::replace(&mut batch, Vec::with_capacity(size));
                    if tx.send(Ok(full)).await.is_err() || done {
                        return;
                    }
                }
            }
        });
        let mut folded = Ok(self.last_seq);
        while self.last_seq < target {
            let Some(batch) = rx.recv().await else {
                break;
            };
            if let Err(e) = batch
                .map_err(ProjectionError::from)
                .and_then(|b| self.apply_decoded(&b))
            {
                folded = Err(e);
                break;
            }
        }
        reader.abort();
        let written = self.writer.take().map_or(Ok(()), behind::Writer::finish);
        *self.archive.overlay() = pack::Overlay::default();
        self.keys.clear();
        if let Err(reason) = written {
            let failed = self.behind_failed(reason);
            return Err(folded.err().unwrap_or(failed));
        }
        folded.map(|_| self.last_seq)
    }

    /// The row of live workload `id`, as of the event at `seq`.
    fn row_of(&self, id: WorkloadId, seq: u64) -> Option<WorkloadRow> {
        let w = self.state.workloads().get(&id)?;
        let running = w.phase == Phase::Running;
        Some(WorkloadRow {
            id,
            allocation: self.state.allocation_path(w).map(str::to_owned),
            user: self.state.submitter(w).to_owned(),
            phase: w.phase,
            gpus_per_node: w.gpus_per_node,
            nodes: w.nodes,
            priority: w.priority,
            submit_seq: w.submit_seq,
            submitted_at_ms: w.submitted_at_ms,
            started_at_ms: (w.starts > 0).then_some(w.started_at_ms),
            protected_until_ms: running.then_some(w.protected_until_ms),
            borrowed: w.borrowed,
            placement: w
                .placement
                .iter()
                .map(|p| PlacedRow {
                    node: self.state.cluster().node(p.node).name.clone(),
                    gpus: (0..64).filter(|g| p.gpus & (1u64 << g) != 0).collect(),
                })
                .collect(),
            preempting: w.preempting.is_some(),
            starts: w.starts,
            work_done_ms: w.work_done_ms,
            last_seq: seq,
            ended_at_ms: None,
            history: Vec::new(),
            rejected: Vec::new(),
            exit_code: None,
            signal: None,
            error: None,
            name: None,
            run_ms: 0,
            ran_on: Vec::new(),
            preemptions: w.preemptions,
        })
    }

    /// The writer behind a catching-up fold failed: the projection is poisoned.
    fn behind_failed(&mut self, reason: String) -> ProjectionError {
        self.poisoned = true;
        ProjectionError::Storage {
            dir: self.dir.clone(),
            reason: format!("writing a batch: {reason}"),
        }
    }

    fn storage(&self, e: sled::Error) -> ProjectionError {
        ProjectionError::Storage {
            dir: self.dir.clone(),
            reason: e.to_string(),
        }
    }

    fn corrupt(&self, reason: &str) -> ProjectionError {
        ProjectionError::Corrupt {
            dir: self.dir.clone(),
            reason: reason.to_owned(),
        }
    }

    fn fault(&self, f: Fault) -> ProjectionError {
        f.into_error(&self.dir)
    }
}

/// A stored event and what its payload decoded to.
#[derive(Clone, Debug)]
pub struct Decoded {
    /// Its sequence.
    pub seq: u64,
    /// The envelope, or why it did not decode.
    pub envelope: Result<Box<Envelope>, Undecodable>,
    /// What the log's chain of heads hashes for it ([`ledger::chain::hashed`]), worked out
    /// with the decoding, off the fold's thread.
    pub hashed: Vec<u8>,
}

/// Why a stored event could not be read as an envelope.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Undecodable {
    /// Not an envelope at all.
    #[error("{0}")]
    Malformed(String),
    /// Written by a newer build, in a schema version this one does not know.
    #[error("schema version {version} is not known to this build (it reads {oldest} to {newest})", oldest = ledger::event::OLDEST_SCHEMA_VERSION, newest = ledger::event::SCHEMA_VERSION)]
    UnknownSchemaVersion {
        /// The event's version.
        version: u16,
    },
}

impl Undecodable {
    /// The code recorded for the event in the projection's rejections.
    pub fn code(&self) -> &'static str {
        match self {
            Undecodable::Malformed(_) => "malformed",
            Undecodable::UnknownSchemaVersion { .. } => "unknown_schema_version",
        }
    }
}

impl From<&Stored> for Decoded {
    fn from(e: &Stored) -> Self {
        Decoded {
            seq: e.seq,
            // A schema version this build does not know is the fold's to reject, as every
            // folder does (its clock moves to the event's time first): only what is not an
            // envelope at all is skipped here.
            envelope: serde_json::from_slice(&e.payload)
                .map(Box::new)
                .map_err(|e| Undecodable::Malformed(e.to_string())),
            hashed: ledger::chain::hashed(&e.payload),
        }
    }
}

/// Decodes one stored event for a reader that acts on it outside the fold (notifications, a
/// page of events), refusing schema versions this build does not know: the fold rejects those.
pub fn decode(payload: &[u8]) -> Result<Envelope, Undecodable> {
    let env: Envelope =
        serde_json::from_slice(payload).map_err(|e| Undecodable::Malformed(e.to_string()))?;
    let known = ledger::event::OLDEST_SCHEMA_VERSION..=ledger::event::SCHEMA_VERSION;
    if !known.contains(&env.schema_version) {
        return Err(Undecodable::UnknownSchemaVersion {
            version: env.schema_version,
        });
    }
    Ok(env)
}

fn json<T: Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).expect("rows always serialize")
}

/// The key of a kept row: `k/`, the granularity, the period's start and the allocation
/// (`u32::MAX` for the cluster), so that one granularity's rows lie in period order.
fn kept_key(row: &Row) -> [u8; 15] {
    kept_key_of(
        row.granularity(),
        row.from_ms(),
        row.allocation().unwrap_or(u32::MAX),
    )
}

fn kept_key_of(granularity: Granularity, from_ms: u64, allocation: u32) -> [u8; 15] {
    let mut k = [0u8; 15];
    k[..2].copy_from_slice(b"k/");
    k[2] = granularity.code();
    k[3..11].copy_from_slice(&from_ms.to_be_bytes());
    k[11..].copy_from_slice(&allocation.to_be_bytes());
    k
}

fn postcard_row(row: &Row) -> Vec<u8> {
    postcard::to_stdvec(row).expect("rows always serialize")
}

/// Which workloads a listing wants; every condition given must hold.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkloadFilter {
    /// In any of these phases; all phases when empty.
    pub phases: Vec<Phase>,
    /// Charged to this allocation or one under it.
    pub allocation: Option<String>,
    /// Submitted by this principal: its name (`alice`) or actor (`user:alice`).
    pub user: Option<String>,
    /// Still live at this time, or ended at or after it.
    pub since_ms: Option<u64>,
    /// Submitted before this time.
    pub until_ms: Option<u64>,
}

impl WorkloadFilter {
    /// Whether `row` is wanted.
    pub fn admits(&self, row: &WorkloadRow) -> bool {
        (self.phases.is_empty() || self.phases.contains(&row.phase))
            && self.allocation.as_deref().is_none_or(|a| {
                row.allocation.as_deref().is_some_and(|path| {
                    path == a
                        || (path.starts_with(a) && path.as_bytes().get(a.len()) == Some(&b'/'))
                })
            })
            && self.user.as_deref().is_none_or(|u| is_user(&row.user, u))
            && self
                .since_ms
                .is_none_or(|t| row.ended_at_ms.is_none_or(|end| end >= t))
            && self.until_ms.is_none_or(|t| row.submitted_at_ms < t)
    }
}

/// Whether `actor` (`user:alice`) is the principal `user` names (`alice` or `user:alice`).
pub fn is_user(actor: &str, user: &str) -> bool {
    actor == user || actor.split_once(':').is_some_and(|(_, name)| name == user)
}

/// One page of a listing of workloads.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WorkloadPage {
    /// The workloads, newest first.
    pub rows: Vec<WorkloadRow>,
    /// The workload to ask the next page before, while older ones are left.
    pub next: Option<WorkloadId>,
    /// Rows read to make the page.
    pub scanned: usize,
}

/// Reads the kept rows of closed periods straight from sled: sled shows every batch whole or
/// not at all, so a reader needs no lock and never holds up the fold.
#[derive(Clone)]
pub struct Kept {
    tree: sled::Tree,
    dir: PathBuf,
    /// Held while a listing reads rows in order, so packing does not move them meanwhile.
    layout: std::sync::Arc<std::sync::RwLock<()>>,
}

impl Kept {
    /// The rows of `granularity` whose periods start in `[from_ms, to_ms)`, in period order
    /// (the cluster's last in each period).
    pub fn rows(
        &self,
        granularity: Granularity,
        from_ms: u64,
        to_ms: u64,
    ) -> Result<Vec<Row>, ProjectionError> {
        let mut out = Vec::new();
        if from_ms >= to_ms {
            return Ok(out);
        }
        let start = kept_key_of(granularity, from_ms, 0);
        let end = kept_key_of(granularity, to_ms, 0);
        for entry in self.tree.range(start..end) {
            let (_, v) = entry.map_err(|e| ProjectionError::Storage {
                dir: self.dir.clone(),
                reason: e.to_string(),
            })?;
            out.push(
                postcard::from_bytes(&v).map_err(|e| ProjectionError::Corrupt {
                    dir: self.dir.clone(),
                    reason: format!("kept row: {e}"),
                })?,
            );
        }
        Ok(out)
    }

    /// Workloads that `filter` admits, newest first (in id order backwards, which for the
    /// UUIDv7 ids the ledger makes is submission order), from the one before `before` (from the
    /// newest when `None`): at most `limit` of them, and no more than `budget` rows read, so a
    /// selective filter over a long history answers in pages of bounded work.
    /// [`WorkloadPage::next`] is where the next page starts, while any are left.
    pub fn workloads(
        &self,
        filter: &WorkloadFilter,
        before: Option<WorkloadId>,
        limit: usize,
        budget: usize,
    ) -> Result<WorkloadPage, ProjectionError> {
        let corrupt = |reason: String| ProjectionError::Corrupt {
            dir: self.dir.clone(),
            reason,
        };
        let _layout = self.layout.read().unwrap_or_else(|e| e.into_inner());
        let fault = |f: Fault| f.into_error(&self.dir);
        let mut page = WorkloadPage::default();
        for entry in pack::Rows::descending(&self.tree, before) {
            if page.rows.len() >= limit || page.scanned >= budget {
                break;
            }
            let (id, v) = entry.map_err(fault)?;
            let row: WorkloadRow =
                postcard::from_bytes(&v).map_err(|e| corrupt(format!("workload row {id}: {e}")))?;
            page.scanned += 1;
            page.next = Some(row.id);
            if filter.admits(&row) {
                page.rows.push(row);
            }
        }
        // Nothing left before the last row read: no next page.
        if let Some(next) = page.next {
            if !pack::any_before(&self.tree, next).map_err(fault)? {
                page.next = None;
            }
        }
        Ok(page)
    }

    /// Every kept row, in key order.
    pub fn all(&self) -> Result<Vec<Row>, ProjectionError> {
        let mut out = Vec::new();
        for g in Granularity::ALL {
            out.extend(self.rows(g, 0, u64::MAX)?);
        }
        Ok(out)
    }

    /// Overwrites one kept row (for tests that prove `audit verify` catches a tampered one).
    #[doc(hidden)]
    pub fn overwrite(&self, row: &Row) -> Result<(), ProjectionError> {
        self.tree
            .insert(kept_key(row), postcard_row(row))
            .map(|_| ())
            .map_err(|e| ProjectionError::Storage {
                dir: self.dir.clone(),
                reason: e.to_string(),
            })
    }
}

fn idempotency_key(key: &str) -> Vec<u8> {
    prefixed(b"i/", key.as_bytes())
}

/// An `i/` row: the workload the key's first submission created, and its sequence.
fn key_row(id: WorkloadId, seq: u64) -> Vec<u8> {
    postcard::to_stdvec(&(id, seq)).expect("key rows always serialize")
}

fn rejection_key(seq: u64) -> [u8; 10] {
    let mut k = [0u8; 10];
    k[..2].copy_from_slice(b"r/");
    k[2..].copy_from_slice(&seq.to_be_bytes());
    k
}

fn prefixed(prefix: &[u8], rest: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(prefix.len() + rest.len());
    k.extend_from_slice(prefix);
    k.extend_from_slice(rest);
    k
}

fn u64_of(v: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(v.try_into().ok()?))
}

/// A row's phase stored and answered by its name ([`Phase::name`]), as rows always were.
mod phase_name {
    use ledger::Phase;

    pub fn serialize<S: serde::Serializer>(phase: &Phase, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(phase.name())
    }

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Phase, D::Error> {
        let name = <std::borrow::Cow<'de, str> as serde::Deserialize>::deserialize(d)?;
        // A row ended without a known phase (`ended`, which a consistent projection never
        // wrote) is still ended.
        Ok(Phase::of_name(&name).unwrap_or(Phase::Finished))
    }
}
