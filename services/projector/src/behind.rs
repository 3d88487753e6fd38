//! Writing a catching-up fold's batches behind it.
//!
//! Catching up, nobody reads the projection but the fold itself, and sled's writes were a
//! third of the fold's time: a thread of their own writes each batch while the fold goes on
//! with the next. One batch at most is being written: before a batch's own reads of the tree
//! (packing, rewriting packs) the fold waits for the one before. Meanwhile the fold's lookups
//! of its own rows (an ended workload, a used key) find that batch's rows and keys in an
//! [`Overlay`](crate::pack::Overlay) before the tree, so the fold sees exactly what it would had the batch been
//! written at once. A checkpoint taken meanwhile waits for the batches it follows before it is
//! written, so a stored checkpoint is never ahead of the stored rows.

use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// How far the writer has written: the last sequence of the last batch it wrote, or why it
/// stopped.
#[derive(Default)]
pub(crate) struct Progress {
    written: Mutex<(u64, Option<String>)>,
    moved: Condvar,
}

impl Progress {
    /// Waits until the batches through `seq` are written; the writer's failure if it failed.
    pub(crate) fn wait(&self, seq: u64) -> Result<(), String> {
        let mut written = self.written.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(reason) = &written.1 {
                return Err(reason.clone());
            }
            if written.0 >= seq {
                return Ok(());
            }
            written = self.moved.wait(written).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn record(&self, outcome: Result<u64, String>) {
        let mut written = self.written.lock().unwrap_or_else(|e| e.into_inner());
        match outcome {
            Ok(seq) => written.0 = seq,
            Err(reason) => written.1 = Some(reason),
        }
        self.moved.notify_all();
    }
}

/// Records a panicking writer as failed, so nothing waits for it forever.
struct Stopped<'a>(&'a Progress);

impl Drop for Stopped<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0
                .record(Err("the projection's writer panicked".into()));
        }
    }
}

/// The thread writing batches behind the fold.
pub(crate) struct Writer {
    batches: Option<mpsc::SyncSender<(u64, sled::Batch)>>,
    progress: Arc<Progress>,
    thread: Option<JoinHandle<()>>,
    /// The last sequence of the last batch handed over.
    sent: u64,
}

impl Writer {
    /// Starts a writer into `tree`, the fold being at `seq`.
    pub(crate) fn start(tree: sled::Tree, seq: u64) -> std::io::Result<Writer> {
        let (batches, inbox) = mpsc::sync_channel::<(u64, sled::Batch)>(1);
        let progress = Arc::new(Progress::default());
        progress.record(Ok(seq));
        let recorder = progress.clone();
        let thread = std::thread::Builder::new()
            .name("projection-writer".into())
            .spawn(move || {
                let _stopped = Stopped(&recorder);
                for (seq, batch) in inbox {
                    let outcome = tree
                        .apply_batch(batch)
                        .map(|()| seq)
                        .map_err(|e| e.to_string());
                    let failed = outcome.is_err();
                    recorder.record(outcome);
                    if failed {
                        return;
                    }
                }
            })?;
        Ok(Writer {
            batches: Some(batches),
            progress,
            thread: Some(thread),
            sent: seq,
        })
    }

    pub(crate) fn progress(&self) -> Arc<Progress> {
        self.progress.clone()
    }

    /// Waits until every batch handed over is written.
    pub(crate) fn settle(&self) -> Result<(), String> {
        self.progress.wait(self.sent)
    }

    /// Hands over `batch`, the fold's writes through `seq`.
    pub(crate) fn send(&mut self, seq: u64, batch: sled::Batch) -> Result<(), String> {
        let sent = self
            .batches
            .as_ref()
            .is_some_and(|b| b.send((seq, batch)).is_ok());
        if !sent {
            // The thread stopped: its failure says why.
            self.settle()?;
            return Err("the projection's writer stopped".into());
        }
        self.sent = seq;
        Ok(())
    }

    /// Waits for everything handed over, then stops the thread.
    pub(crate) fn finish(mut self) -> Result<(), String> {
        let settled = self.settle();
        if !self.stop() {
            return Err("the projection's writer panicked".into());
        }
        settled
    }

    /// Closes the inbox and joins the thread; false if it panicked.
    fn stop(&mut self) -> bool {
        self.batches = None;
        self.thread.take().is_none_or(|t| t.join().is_ok())
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.stop();
    }
}
