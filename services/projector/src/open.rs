//! Opening a projection: from its stored rows and checkpoint, rebuilt when it is corrupt,
//! built with other settings or ahead of its log.

use super::*;

impl Projector {
    /// Opens the projection in `dir` (creating it if new) and brings its in-memory state up to
    /// the stored sequence from the checkpoint and the log. Does not read past the stored
    /// sequence: call [`Projector::catch_up`] or [`follow`] for that.
    pub async fn open<L: EventLog>(
        dir: &Path,
        config: StateConfig,
        log: &L,
    ) -> Result<Self, ProjectionError> {
        Self::open_with(dir, Some(config), log).await
    }

    /// Opens an existing projection with the fold settings it was built with (for tools that
    /// read one a server wrote, such as `audit verify`).
    pub async fn open_existing<L: EventLog>(dir: &Path, log: &L) -> Result<Self, ProjectionError> {
        if !dir.join("conf").exists() && !dir.join("db").exists() {
            return Err(ProjectionError::Storage {
                dir: dir.to_owned(),
                reason:
                    "there is no projection here; name the one the server keeps (DATA/projection)"
                        .into(),
            });
        }
        Self::open_with(dir, None, log).await
    }

    pub(crate) async fn open_with<L: EventLog>(
        dir: &Path,
        config: Option<StateConfig>,
        log: &L,
    ) -> Result<Self, ProjectionError> {
        // A log that sets its settings before anything they rule (after the service's own
        // grants, which no setting touches) folds alike whatever configuration the fold starts
        // from: a projection built from another one is the same projection.
        let settles_itself = log
            .read(1, 4)
            .await?
            .iter()
            .map(|e| decode(&e.payload).map(|env| env.event))
            .find(|event| !matches!(event, Ok(Event::PrincipalGranted(_))))
            .is_some_and(|event| matches!(event, Ok(Event::SettingsSet(_))));
        let mut p = Self::open_stored(dir, config, settles_itself)?;
        let log_last = log.last_seq().await?;
        if p.last_seq > log_last {
            return Err(ProjectionError::AheadOfLog {
                dir: dir.to_owned(),
                projected: p.last_seq,
                log: log_last,
            });
        }
        // Refold, in memory only, what the projection applied after the checkpoint.
        while p.state.last_seq() < p.last_seq {
            let events = log
                .read(
                    p.state.last_seq() + 1,
                    (p.last_seq - p.state.last_seq()) as usize,
                )
                .await?;
            if events.is_empty() {
                return Err(ProjectionError::Corrupt {
                    dir: dir.to_owned(),
                    reason: format!(
                        "the log has no event after {} to reach the projected {}",
                        p.state.last_seq(),
                        p.last_seq
                    ),
                });
            }
            refold(&mut p.state, &mut p.book, &events, p.last_seq);
        }
        if p.archive.failed.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(ProjectionError::Storage {
                dir: dir.to_owned(),
                reason: "a read of the projection's own rows failed while refolding".into(),
            });
        }
        // The rows those events closed, the workloads they ended and the keys they used are
        // stored already.
        p.book.take_closed();
        p.state.archived();
        Ok(p)
    }

    /// Like [`Projector::open`], but a projection that is corrupt, was built with other
    /// settings or belongs to another log is deleted and rebuilt from the log (it is
    /// disposable: the log is the record).
    pub async fn open_or_rebuild<L: EventLog>(
        dir: &Path,
        config: StateConfig,
        log: &L,
    ) -> Result<Self, ProjectionError> {
        match Self::open(dir, config, log).await {
            Err(e) if e.is_rebuildable() => {
                tracing::warn!(error = %e, "rebuilding the projection from the log");
                std::fs::remove_dir_all(dir).map_err(|io| ProjectionError::Storage {
                    dir: dir.to_owned(),
                    reason: io.to_string(),
                })?;
                Self::open(dir, config, log).await
            }
            other => other,
        }
    }

    /// Opens the stored projection; `adopt` opens it with the configuration it was built with,
    /// whatever `config` says (the log sets its own settings first).
    pub(crate) fn open_stored(
        dir: &Path,
        config: Option<StateConfig>,
        adopt: bool,
    ) -> Result<Self, ProjectionError> {
        let storage = |e: sled::Error| match e {
            sled::Error::Corruption { .. } => ProjectionError::Corrupt {
                dir: dir.to_owned(),
                reason: e.to_string(),
            },
            e => ProjectionError::Storage {
                dir: dir.to_owned(),
                reason: e.to_string(),
            },
        };
        let corrupt = |reason: String| ProjectionError::Corrupt {
            dir: dir.to_owned(),
            reason,
        };
        let db = eventlog::embedded::open_sled(sled::Config::new().path(dir)).map_err(storage)?;
        let tree = db.open_tree("projection").map_err(storage)?;
        let checkpoints = db.open_tree("checkpoint").map_err(storage)?;
        // The fold settings and row format the projection is built with, fixed at creation.
        let stored = tree.get(CONFIG).map_err(storage)?;
        let built_with = |v: &[u8]| -> Option<StateConfig> {
            let (format, c): (u32, StateConfig) = serde_json::from_slice(v).ok()?;
            (format == FORMAT).then_some(c)
        };
        let config = match (config, &stored) {
            (Some(_), Some(v)) if adopt && built_with(v).is_some() => {
                built_with(v).expect("checked")
            }
            (Some(c), _) => c,
            (None, Some(v)) => {
                let (format, c): (u32, StateConfig) =
                    serde_json::from_slice(v).map_err(|e| corrupt(format!("settings: {e}")))?;
                if format != FORMAT {
                    return Err(ProjectionError::OtherSettings {
                        dir: dir.to_owned(),
                    });
                }
                c
            }
            (None, None) => {
                return Err(corrupt("the projection has no settings".into()));
            }
        };
        let settings = serde_json::to_vec(&(FORMAT, &config)).expect("settings serialize");
        match stored {
            None => {
                tree.insert(CONFIG, settings).map_err(storage)?;
            }
            Some(stored) if *stored != *settings => {
                return Err(ProjectionError::OtherSettings {
                    dir: dir.to_owned(),
                });
            }
            Some(_) => {}
        }
        let last_seq = match tree.get(LAST_SEQ).map_err(storage)? {
            None => 0,
            Some(v) => u64_of(&v).ok_or_else(|| corrupt("bad last sequence".into()))?,
        };
        let stats = match tree.get(STATS).map_err(storage)? {
            None => Stats::default(),
            Some(v) => serde_json::from_slice(&v).map_err(|e| corrupt(format!("stats: {e}")))?,
        };
        let (mut state, book) = match read_checkpoint(&checkpoints)
            .map_err(|f| f.into_error(dir))?
        {
            None => (State::new(config), Book::new()),
            Some((state, book)) => {
                let seq = checkpoints
                    .get(CHECKPOINT_SEQ)
                    .map_err(storage)?
                    .and_then(|v| u64_of(&v));
                if seq != Some(state.last_seq()) || state.last_seq() > last_seq {
                    return Err(corrupt(format!(
                        "checkpoint at {:?} disagrees with its state at {} and the projection at {last_seq}",
                        seq, state.last_seq()
                    )));
                }
                if *state.base_config() != config {
                    return Err(ProjectionError::OtherSettings {
                        dir: dir.to_owned(),
                    });
                }
                (state, book)
            }
        };
        if stats.total() > last_seq {
            return Err(corrupt(format!(
                "{} events counted but the projection is at {last_seq}",
                stats.total()
            )));
        }
        let through = pack::through(&tree).map_err(|e| e.into_error(dir))?;
        let newest = pack::Rows::descending(&tree, None)
            .next()
            .transpose()
            .map_err(|e| e.into_error(dir))?
            .map(|(id, _)| id);
        let archive = std::sync::Arc::new(RowArchive {
            tree: tree.clone(),
            failed: false.into(),
            through: std::sync::Arc::new(through.into()),
            overlay: Default::default(),
            newest: std::sync::Arc::new(newest.into()),
        });
        state.archive_in(archive.clone());
        Ok(Projector {
            dir: dir.to_owned(),
            tree,
            checkpoints,
            state,
            book,
            last_seq,
            stats,
            checkpoint_every: CHECKPOINT_EVERY,
            since_checkpoint: 0,
            checkpoint_gap: std::time::Duration::ZERO,
            last_checkpoint: std::time::Instant::now(),
            last_malformed: None,
            poisoned: false,
            trails: Default::default(),
            archive,
            checkpointing: Default::default(),
            checkpoint_due: false,
            layout: Default::default(),
            endings: 0,
            writer: None,
            keys: Vec::new(),
            catch_up_batch: CATCH_UP_BATCH,
            pack_lag: Some(pack::PACK_LAG),
            from_packs: BTreeMap::new(),
        })
    }
}
