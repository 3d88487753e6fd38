//! Checkpoints: the folded state and book written beside the rows, taken aside the fold, and
//! the refolds that reach a sequence from one.

use super::*;

/// The stored checkpoint's state and book, if there is one.
pub(crate) fn read_checkpoint(checkpoints: &sled::Tree) -> Result<Option<(State, Book)>, Fault> {
    let Some(state) = checkpoints.get(CHECKPOINT_STATE)? else {
        return Ok(None);
    };
    let state: State =
        postcard::from_bytes(&state).map_err(|e| Fault::Corrupt(format!("checkpoint: {e}")))?;
    let book = checkpoints
        .get(CHECKPOINT_BOOK)?
        .ok_or_else(|| Fault::Corrupt("the checkpoint has no book".into()))?;
    let book: Book =
        postcard::from_bytes(&book).map_err(|e| Fault::Corrupt(format!("checkpoint book: {e}")))?;
    Ok(Some((state, book)))
}

/// Writes `state` and `book`, with their sequence, in one batch of the checkpoint's tree.
pub(crate) fn write_checkpoint(tree: &sled::Tree, state: &State, book: &Book) -> sled::Result<()> {
    let mut batch = sled::Batch::default();
    let bytes = postcard::to_stdvec(state).expect("the state always serializes");
    batch.insert(CHECKPOINT_STATE, bytes);
    let book = postcard::to_stdvec(book).expect("the book always serializes");
    batch.insert(CHECKPOINT_BOOK, book);
    batch.insert(CHECKPOINT_SEQ, &state.last_seq().to_be_bytes());
    tree.apply_batch(batch)?;
    // On disk now, with every row before it: sled's own flusher may be off (a server's is).
    tree.flush().map(drop)
}

/// Folds `events` (ascending) up to sequence `to` into `state` and `book`, in memory only, as
/// the projection folded them: an event that does not decode is skipped, its sequence counted.
pub(crate) fn refold(state: &mut State, book: &mut Book, events: &[Stored], to: u64) {
    let events: Vec<&Stored> = events.iter().take_while(|e| e.seq <= to).collect();
    // In slices, so that what is hashed ahead stays small beside the events.
    for slice in events.chunks(16 * 1024) {
        let hashed = hashed_in_parallel(slice);
        for (e, hashed) in slice.iter().zip(hashed) {
            if let Ok(env) = decode(&e.payload) {
                book.apply(state, e.seq, &env);
            }
            book.link_hashing(e.seq, &hashed);
            state.skip(e.seq);
        }
    }
}

/// What the chain of heads hashes for each of `events` ([`ledger::chain::hashed`]), worked out
/// on every core: the one costly step of chaining, which does not depend on the order.
pub(crate) fn hashed_in_parallel(events: &[&Stored]) -> Vec<Vec<u8>> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    if threads < 2 || events.len() < 1024 {
        return events
            .iter()
            .map(|e| ledger::chain::hashed(&e.payload))
            .collect();
    }
    let chunk = events.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let parts: Vec<_> = events
            .chunks(chunk)
            .map(|part| {
                scope.spawn(move || {
                    part.iter()
                        .map(|e| ledger::chain::hashed(&e.payload))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        parts
            .into_iter()
            .flat_map(|p| p.join().expect("hashing does not panic"))
            .collect()
    })
}

/// The stored checkpoint in `checkpoints` refolded with `log`'s events after it up to `to`, and
/// written there ([`Projector::checkpoint_beside`]).
pub(crate) fn refold_checkpoint<L: EventLog>(
    checkpoints: &sled::Tree,
    archive: std::sync::Arc<RowArchive>,
    config: StateConfig,
    runtime: &tokio::runtime::Handle,
    log: &L,
    to: u64,
) -> Result<(), String> {
    let (mut state, mut book) = read_checkpoint(checkpoints)
        .map_err(|f| f.to_string())?
        .unwrap_or_else(|| (State::new(config), Book::new()));
    if state.last_seq() >= to {
        return Ok(());
    }
    state.archive_in(archive.clone());
    while state.last_seq() < to {
        let from = state.last_seq() + 1;
        let max = (to - state.last_seq()).min(BATCH as u64 * 16) as usize;
        let events = runtime
            .block_on(log.read(from, max))
            .map_err(|e| e.to_string())?;
        if events.is_empty() {
            return Err(format!(
                "the log has no event after {} to reach {to}",
                from - 1
            ));
        }
        refold(&mut state, &mut book, &events, to);
        // Written by the fold already.
        book.take_closed();
    }
    if archive.failed.load(std::sync::atomic::Ordering::SeqCst) {
        return Err("a read of the projection's own rows failed while refolding".into());
    }
    state.archived();
    write_checkpoint(checkpoints, &state, &book).map_err(|e| e.to_string())
}

impl Projector {
    /// Copies the state and the book and writes them as a checkpoint on a thread of its own:
    /// serializing and writing (a tenth of a second or more with 100,000 live workloads) go on
    /// beside the fold. The copy itself (about 1.3 µs a live workload) holds the fold up: a
    /// projection others wait on refolds its checkpoints instead ([`Projector::checkpoint_beside`]).
    pub(crate) fn start_checkpoint(&self) -> Result<(), ProjectionError> {
        let started = std::time::Instant::now();
        let (state, book) = (self.state.clone(), self.book.clone());
        tracing::debug!(
            took_ms = started.elapsed().as_millis() as u64,
            seq = state.last_seq(),
            "copied the state for a checkpoint"
        );
        let tree = self.checkpoints.clone();
        // Written behind the fold, the rows it follows may still be on their way.
        let rows = self.writer.as_ref().map(behind::Writer::progress);
        let writing = std::thread::Builder::new()
            .name("checkpoint".into())
            .spawn(move || {
                if let Some(rows) = rows {
                    rows.wait(state.last_seq())?;
                }
                write_checkpoint(&tree, &state, &book).map_err(|e| e.to_string())
            })
            .map_err(|e| ProjectionError::Storage {
                dir: self.dir.clone(),
                reason: format!("cannot start the checkpoint's thread: {e}"),
            })?;
        *self.checkpointing.lock().expect("never poisoned") = Some(writing);
        Ok(())
    }

    /// Writes a checkpoint of the last applied sequence on a thread of its own without touching
    /// the folded state: the stored checkpoint (or nothing) refolded with the log's events after
    /// it up to that sequence, as opening the projection refolds (the projection's rows, ahead of
    /// it, answer for the workloads that ended and the keys used before the stored checkpoint).
    /// A copy of the state, taken where the fold waits, held every acknowledgement for about
    /// 1.3 µs per live workload (a third of a second at 250,000); this costs the fold nothing.
    /// Does nothing while a checkpoint is being written.
    pub fn checkpoint_beside<L: EventLog + Clone>(&self, log: &L) -> Result<(), ProjectionError> {
        if !self.settle_checkpoint(false)? {
            return Ok(());
        }
        let to = self.last_seq;
        let checkpoints = self.checkpoints.clone();
        let archive = std::sync::Arc::new(RowArchive {
            tree: self.tree.clone(),
            failed: false.into(),
            through: self.archive.through.clone(),
            overlay: Default::default(),
            newest: self.archive.newest.clone(),
        });
        let config = *self.state.base_config();
        let log = log.clone();
        let runtime = tokio::runtime::Handle::current();
        let writing = std::thread::Builder::new()
            .name("checkpoint".into())
            .spawn(move || {
                let started = std::time::Instant::now();
                match refold_checkpoint(&checkpoints, archive, config, &runtime, &log, to) {
                    Ok(()) => tracing::debug!(
                        took_ms = started.elapsed().as_millis() as u64,
                        seq = to,
                        "refolded a checkpoint"
                    ),
                    // The checkpoint before stands; the next one is tried as usual.
                    Err(reason) => {
                        tracing::warn!(seq = to, %reason, "could not write a checkpoint")
                    }
                }
                Ok(())
            })
            .map_err(|e| ProjectionError::Storage {
                dir: self.dir.clone(),
                reason: format!("cannot start the checkpoint's thread: {e}"),
            })?;
        *self.checkpointing.lock().expect("never poisoned") = Some(writing);
        Ok(())
    }

    /// The stored checkpoint's state and book, once any being written is. For tests of
    /// checkpoints.
    #[doc(hidden)]
    pub fn stored_checkpoint(&self) -> Result<Option<(State, Book)>, ProjectionError> {
        self.settle_checkpoint(true)?;
        read_checkpoint(&self.checkpoints).map_err(|f| self.fault(f))
    }

    /// Whether no checkpoint is being written any more (`wait`: waits until none is), or the
    /// error of the one that was.
    pub(crate) fn settle_checkpoint(&self, wait: bool) -> Result<bool, ProjectionError> {
        let mut writing = self.checkpointing.lock().expect("never poisoned");
        match writing.take() {
            None => Ok(true),
            Some(w) if !wait && !w.is_finished() => {
                *writing = Some(w);
                Ok(false)
            }
            Some(w) => match w.join() {
                Ok(Ok(())) => Ok(true),
                Ok(Err(reason)) => Err(ProjectionError::Storage {
                    dir: self.dir.clone(),
                    reason: format!("writing a checkpoint: {reason}"),
                }),
                Err(_) => Err(ProjectionError::Storage {
                    dir: self.dir.clone(),
                    reason: "the checkpoint's thread panicked".into(),
                }),
            },
        }
    }

    /// Writes a checkpoint now, after any being written, and flushes everything to disk (on
    /// shutdown).
    pub fn checkpoint(&mut self) -> Result<(), ProjectionError> {
        self.settle_checkpoint(true)
            .inspect_err(|_| self.poisoned = true)?;
        self.since_checkpoint = 0;
        self.last_checkpoint = std::time::Instant::now();
        write_checkpoint(&self.checkpoints, &self.state, &self.book).map_err(|e| {
            self.poisoned = true;
            self.storage(e)
        })
    }
}
