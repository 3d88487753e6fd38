//! The fold and its writes: each batch of events applied to the state, and the rows it
//! changed written in one sled batch.

use super::*;

impl Projector {
    /// Folds `events` (in log order) and writes the result and the new last sequence in one
    /// atomic sled batch. Events at or below the last applied sequence are skipped.
    pub fn apply(&mut self, events: &[Stored]) -> Result<usize, ProjectionError> {
        let decoded: Vec<Decoded> = events.iter().map(Decoded::from).collect();
        self.apply_decoded(&decoded)
    }

    /// [`Projector::apply`] of events already decoded (by a reader running ahead).
    pub fn apply_decoded(&mut self, events: &[Decoded]) -> Result<usize, ProjectionError> {
        let result = self.fold_batch(events);
        if !self.poisoned && std::mem::take(&mut self.checkpoint_due) {
            self.start_checkpoint()?;
        }
        result
    }

    /// Folds and writes `events`, noting when a checkpoint is due without taking its copy.
    pub(crate) fn fold_batch(&mut self, events: &[Decoded]) -> Result<usize, ProjectionError> {
        if self.poisoned {
            return Err(ProjectionError::Poisoned {
                dir: self.dir.clone(),
            });
        }
        // Only a failed read by this fold stops it (a reader's, between folds, answered
        // without changing anything).
        self.archive
            .failed
            .store(false, std::sync::atomic::Ordering::SeqCst);
        let mut batch = sled::Batch::default();
        let mut rows: BTreeMap<WorkloadId, WorkloadRow> = BTreeMap::new();
        let mut applied = 0;
        for e in events {
            if e.seq <= self.last_seq {
                continue;
            }
            if e.seq != self.last_seq + 1 {
                // The ledger never deletes, so a hole means the reader lost events: stop
                // before the hole rather than skip it.
                self.write(batch, &rows)?;
                return Err(ProjectionError::Gap {
                    expected: self.last_seq + 1,
                    got: e.seq,
                });
            }
            applied += 1;
            match &e.envelope {
                Err(undecodable) => {
                    let reason = undecodable.to_string();
                    tracing::warn!(seq = e.seq, %reason, "skipping an event that does not decode");
                    self.stats.malformed += 1;
                    let row = RejectedRow {
                        kind: None,
                        code: undecodable.code().into(),
                        message: reason.clone(),
                        field: None,
                    };
                    batch.insert(rejection_key(e.seq).to_vec(), json(&row));
                    self.last_malformed = Some((e.seq, reason));
                    // The ledger's sequence moves on even though its state does not.
                    self.state.skip(e.seq);
                }
                Ok(env) => {
                    let env = &**env;
                    let about = env.event.workload();
                    // An ending removes the workload from the state: keep its row as it was.
                    let ending = matches!(
                        env.event,
                        Event::WorkloadFinished(_)
                            | Event::WorkloadCancelled(_)
                            | Event::WorkloadStopped(ledger::event::WorkloadStopped {
                                reason: ledger::event::StopReason::Cancelled,
                                ..
                            })
                    );
                    let before = about
                        .filter(|_| ending)
                        .and_then(|id| self.row_of(id, e.seq));
                    // The start of the run this event may end.
                    let running_since = about
                        .and_then(|id| self.state.workloads().get(&id))
                        .filter(|w| w.phase == Phase::Running)
                        .map(|w| w.started_at_ms);
                    match self.book.apply(&mut self.state, e.seq, env) {
                        Outcome::Applied => {
                            self.stats.applied += 1;
                            if let Event::WorkloadSubmitted(ledger::event::WorkloadSubmitted {
                                workload,
                                idempotency_key: Some(key),
                                ..
                            }) = &env.event
                            {
                                let (key, row) = (idempotency_key(key), key_row(*workload, e.seq));
                                if self.writer.is_some() {
                                    self.keys.push((key.clone(), row.clone()));
                                }
                                batch.insert(key, row);
                            }
                            if let Some(id) = about {
                                // Its trail so far: kept in memory while it lives, else the
                                // stored row's.
                                let new = matches!(env.event, Event::WorkloadSubmitted(_));
                                let mut trail = self.trail(id, new)?;
                                trail.history.push(e.seq);
                                if let Event::WorkloadSubmitted(s) = &env.event {
                                    trail.name.clone_from(&s.name);
                                }
                                let mut row = match self.row_of(id, e.seq) {
                                    Some(row) => row,
                                    None => {
                                        let phase = self.state.ended_phase(id);
                                        let mut row = before.ok_or_else(|| {
                                            self.corrupt("an ending applied to an unknown workload")
                                        })?;
                                        row.phase = phase.unwrap_or(Phase::Finished);
                                        row.placement.clear();
                                        row.preempting = false;
                                        row.protected_until_ms = None;
                                        row.ended_at_ms = Some(self.state.now_ms());
                                        if let Event::WorkloadFinished(f) = &env.event {
                                            row.exit_code = f.exit_code;
                                            row.signal = f.signal;
                                            row.error.clone_from(&f.error);
                                        }
                                        row
                                    }
                                };
                                if let Some(since) = running_since {
                                    if row.phase != Phase::Running {
                                        trail.run_ms += self.state.now_ms().saturating_sub(since);
                                    }
                                }
                                if !row.placement.is_empty() {
                                    trail.ran_on =
                                        row.placement.iter().map(|p| p.node.clone()).collect();
                                }
                                trail.onto(&mut row);
                                if row.ended_at_ms.is_none() {
                                    self.trails.insert(id, trail);
                                }
                                rows.insert(id, row);
                            }
                        }
                        Outcome::Duplicate { .. } => self.stats.duplicates += 1,
                        Outcome::Rejected(r) => {
                            self.stats.rejected += 1;
                            let row = RejectedRow::of(&r, &env.event);
                            batch.insert(rejection_key(e.seq).to_vec(), json(&row));
                            if let Some(id) = about {
                                self.note_rejected(id, e.seq, &mut rows)?;
                            }
                        }
                    }
                }
            }
            self.book.link_hashing(e.seq, &e.hashed);
            self.last_seq = e.seq;
            self.since_checkpoint += 1;
        }
        if applied > 0 {
            self.write(batch, &rows)?;
        }
        Ok(applied)
    }

    /// The trail of workload `id`: in memory while it lives, else read from its stored row
    /// (`new`: it has none yet).
    pub(crate) fn trail(&mut self, id: WorkloadId, new: bool) -> Result<Trail, ProjectionError> {
        if let Some(t) = self.trails.remove(&id) {
            return Ok(t);
        }
        if new {
            return Ok(Trail::default());
        }
        Ok(self
            .workload(id)?
            .map(|r| Trail::of_row(&r))
            .unwrap_or_default())
    }

    /// Records on workload `id`'s row that the event at `seq` about it was refused.
    pub(crate) fn note_rejected(
        &mut self,
        id: WorkloadId,
        seq: u64,
        rows: &mut BTreeMap<WorkloadId, WorkloadRow>,
    ) -> Result<(), ProjectionError> {
        let row = match rows.remove(&id) {
            Some(row) => Some(row),
            None => self.stored_row(id)?.map(|(row, place)| {
                if let pack::Place::Packed(key) = place {
                    self.from_packs.insert(id, key);
                }
                row
            }),
        };
        // A refused submission of a new id has no row to note it on.
        let Some(mut row) = row else {
            return Ok(());
        };
        let live = self.state.workloads().contains_key(&id);
        // Its trail: in memory while it lives, else the row's own (which may be newer than
        // the stored one, from this very batch).
        let mut trail = self
            .trails
            .remove(&id)
            .unwrap_or_else(|| Trail::of_row(&row));
        trail.rejected.push(seq);
        row.rejected = trail.rejected.clone();
        if live {
            self.trails.insert(id, trail);
        }
        rows.insert(id, row);
        Ok(())
    }

    /// Adds the rows, the allocations, the meta rows and maybe a checkpoint to `batch` and
    /// writes it atomically.
    pub(crate) fn write(
        &mut self,
        mut batch: sled::Batch,
        rows: &BTreeMap<WorkloadId, WorkloadRow>,
    ) -> Result<(), ProjectionError> {
        // Catching up, the batch before is being written behind: what follows reads the tree.
        if let Some(writer) = &self.writer {
            if let Err(reason) = writer.settle() {
                return Err(self.behind_failed(reason));
            }
        }
        // What this batch writes, for the fold's lookups while it is written behind.
        let mut overlay = self.writer.as_ref().map(|_| pack::Overlay {
            keys: std::mem::take(&mut self.keys).into_iter().collect(),
            ..Default::default()
        });
        let through = self.archive.through();
        let mut repacked: BTreeMap<Vec<u8>, Vec<(WorkloadId, Vec<u8>)>> = BTreeMap::new();
        let mut fresh: BTreeMap<WorkloadId, pack::Fresh> = BTreeMap::new();
        for (id, row) in rows {
            let bytes = postcard::to_stdvec(row).expect("rows always serialize");
            if let Some(key) = self.from_packs.remove(id) {
                repacked.entry(key).or_default().push((*id, bytes));
                continue;
            }
            let ended = row.ended_at_ms.is_some();
            if ended && through.is_none_or(|t| *id > t) {
                self.endings += 1;
            }
            fresh.insert(
                *id,
                pack::Fresh {
                    bytes,
                    ended,
                    submit_seq: row.submit_seq,
                },
            );
        }
        // Before the rows land, like the packing position: looking further is harmless.
        if let Some((&last, _)) = fresh.last_key_value() {
            self.archive.raise_newest(last);
        }
        // Packing goes in the same batch, taking this batch's ended rows straight into packs,
        // unless a listing is reading rows in order (it never waits for one).
        let layout = self.layout.clone();
        let packing_lock = match self.pack_lag {
            Some(lag) if self.endings >= pack::ENDINGS_PER_RUN => {
                layout.try_write().ok().map(|guard| (guard, lag))
            }
            _ => None,
        };
        if let Some((_, lag)) = &packing_lock {
            self.endings = 0;
            let at = pack::At {
                through,
                last_seq: self.last_seq,
                lag: *lag,
                bounded: self.writer.is_none(),
            };
            if let Some(packing) =
                pack::gather(&self.tree, at, &mut fresh, &mut batch, overlay.as_mut())
                    .map_err(|e| self.fault(e))?
            {
                // The position moves first: a reader between the two finds a row in its
                // single or, looking further than it needs, in its pack, never in neither.
                *self
                    .archive
                    .through
                    .lock()
                    .unwrap_or_else(|e| e.into_inner()) = Some(packing.through);
                tracing::trace!(rows = packing.packed, "packed ended workload rows");
                if packing.more {
                    // Again with the next batch.
                    self.endings = pack::ENDINGS_PER_RUN;
                }
            }
        }
        for (id, f) in fresh {
            if let Some(overlay) = &mut overlay {
                overlay
                    .rows
                    .insert(id, (f.bytes.clone(), pack::Place::Single));
            }
            batch.insert(pack::single_key(id), f.bytes);
        }
        self.from_packs.clear();
        for (key, rows) in &repacked {
            pack::rewrite(&self.tree, key, rows, &mut batch).map_err(|e| self.fault(e))?;
            if let Some(overlay) = &mut overlay {
                for (id, bytes) in rows {
                    let place = pack::Place::Packed(key.clone());
                    overlay.rows.insert(*id, (bytes.clone(), place));
                }
            }
        }
        for a in &self.state.allocations().nodes {
            let row = AllocationRow {
                path: a.path.clone(),
                weight: a.weight,
                max_gpus: a.max_gpus,
                removed: a.removed,
                delivered_gpu_ms: a.delivered_gpu_ms,
                owed_gpu_ms: a.owed_gpu_ms,
                preemptions: a.preemptions,
                contract_violations: a.contract_violations,
                live_workloads: a.live_workloads,
            };
            batch.insert(prefixed(b"a/", a.path.as_bytes()), json(&row));
        }
        for row in self.book.take_closed() {
            batch.insert(kept_key(&row).to_vec(), postcard_row(&row));
        }
        batch.insert(LAST_SEQ, &self.last_seq.to_be_bytes());
        batch.insert(STATS, json(&self.stats));
        if self
            .archive
            .failed
            .swap(false, std::sync::atomic::Ordering::SeqCst)
        {
            // The fold read a wrong answer: what it made of this batch must not be written.
            self.poisoned = true;
            return Err(ProjectionError::Storage {
                dir: self.dir.clone(),
                reason: "a read of the projection's own rows failed while folding".into(),
            });
        }
        if let (Some(writer), Some(overlay)) = (&mut self.writer, overlay) {
            // The batch before is written (settled above): the lookups need only this one.
            *self.archive.overlay() = overlay;
            if let Err(reason) = writer.send(self.last_seq, batch) {
                return Err(self.behind_failed(reason));
            }
        } else if let Err(e) = self.tree.apply_batch(batch) {
            self.poisoned = true;
            return Err(self.storage(e));
        }
        self.state.archived();
        if self.since_checkpoint >= self.checkpoint_every
            && self.last_checkpoint.elapsed() >= self.checkpoint_gap
            && self
                .settle_checkpoint(false)
                .inspect_err(|_| self.poisoned = true)?
        {
            self.since_checkpoint = 0;
            self.last_checkpoint = std::time::Instant::now();
            self.checkpoint_due = true;
        }
        Ok(())
    }
}
