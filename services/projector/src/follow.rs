//! Following the log: the projection kept up with it as events arrive (a subscription, and
//! reads while it is made or after it is lost), and a replay of the whole log.

use super::*;

/// Follows the log into the shared projection until `stop` resolves, folding events as they
/// arrive in batches of whatever is ready (at most [`BATCH`]), holding the write lock only while
/// a batch is applied, and announcing each new last sequence on `applied`. A lost subscription
/// (or a hole) is resumed after the last applied sequence. Checkpoints are refolded beside the
/// fold ([`Projector::checkpoint_beside`]). Writes a checkpoint and flushes before returning.
pub async fn follow<L: EventLog + Clone>(
    log: &L,
    projection: &tokio::sync::RwLock<Projector>,
    applied: &tokio::sync::watch::Sender<u64>,
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), ProjectionError> {
    let mut stop = std::pin::pin!(stop.fuse());
    'subscribe: loop {
        let from = projection.read().await.last_seq() + 1;
        // Reading may work where making a reader does not (a cluster with a new leader for the
        // ledger but not yet for its metadata, where readers are made): while a subscription is
        // slow to come, or fails, what can be read is folded, so writes are answered meanwhile.
        let mut subscribing = std::pin::pin!(log.subscribe(from));
        let mut events = loop {
            tokio::select! {
                _ = &mut stop => break 'subscribe,
                subscribed = &mut subscribing => match subscribed {
                    Ok(events) => break events,
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot follow the log; reading it meanwhile");
                        let read = fold_a_read(log, projection, applied).await?;
                        let pause = Duration::from_millis(if read { 20 } else { 200 });
                        tokio::select! {
                            _ = &mut stop => break 'subscribe,
                            _ = tokio::time::sleep(pause) => continue 'subscribe,
                        }
                    }
                },
                _ = tokio::time::sleep(SUBSCRIBING_SLOW) => {
                    fold_a_read(log, projection, applied).await?;
                }
            }
        };
        loop {
            let first = tokio::select! {
                _ = &mut stop => break 'subscribe,
                next = events.next() => next,
            };
            let mut batch = Vec::new();
            let mut failed = false;
            let mut yielded = false;
            let mut item = first;
            loop {
                match item {
                    Some(Ok(e)) => batch.push(Decoded::from(&e)),
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, "lost the log subscription; resuming");
                        failed = true;
                        break;
                    }
                    None => {
                        failed = true;
                        break;
                    }
                }
                if batch.len() >= BATCH {
                    break;
                }
                let mut next = events.next().now_or_never();
                if next.is_none() && !yielded {
                    // Let the tasks that feed the subscription run once, so events arriving one
                    // by one (as from JetStream) fold in batches rather than singly.
                    yielded = true;
                    tokio::task::yield_now().await;
                    next = events.next().now_or_never();
                }
                match next {
                    Some(next) => item = next,
                    None => break,
                }
            }
            match fold(log, projection, applied, &batch).await {
                Ok(_) => {}
                Err(e @ ProjectionError::Gap { .. }) => {
                    tracing::warn!(error = %e, "lost events in the log subscription");
                    continue 'subscribe;
                }
                Err(e) => return Err(e),
            }
            if failed {
                // A pause, so a subscription that keeps failing does not pile readers up on
                // the server.
                tokio::select! {
                    _ = &mut stop => break 'subscribe,
                    _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                }
                continue 'subscribe;
            }
        }
    }
    // A checkpoint being written beside the fold reads the log through this runtime: wait for
    // it without holding the runtime up.
    while !projection.read().await.settle_checkpoint(false)? {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    projection.write().await.checkpoint()
}

/// How long a subscription may take to be made before the follower reads the log meanwhile.
const SUBSCRIBING_SLOW: Duration = Duration::from_millis(250);

/// Folds `batch` and tells the waiters how far the projection now goes (also when folding
/// stopped short).
pub(crate) async fn fold<L: EventLog + Clone>(
    log: &L,
    projection: &tokio::sync::RwLock<Projector>,
    applied: &tokio::sync::watch::Sender<u64>,
    batch: &[Decoded],
) -> Result<usize, ProjectionError> {
    let mut p = projection.write().await;
    let started = std::time::Instant::now();
    let result = p.fold_batch(batch);
    let held = started.elapsed();
    if held > Duration::from_millis(40) {
        // What every reader and acknowledgement waited for.
        tracing::debug!(
            held_ms = held.as_millis() as u64,
            events = batch.len(),
            live = p.state.workloads().len(),
            seq = p.last_seq,
            "a fold held the projection long"
        );
    }
    applied.send_replace(p.last_seq());
    if !p.poisoned && std::mem::take(&mut p.checkpoint_due) {
        p.checkpoint_beside(log)?;
    }
    result
}

/// Folds one read of the log after what is folded; answers whether it found events.
pub(crate) async fn fold_a_read<L: EventLog + Clone>(
    log: &L,
    projection: &tokio::sync::RwLock<Projector>,
    applied: &tokio::sync::watch::Sender<u64>,
) -> Result<bool, ProjectionError> {
    let from = projection.read().await.last_seq() + 1;
    let events = match log.read(from, BATCH).await {
        Ok(events) if !events.is_empty() => events,
        _ => return Ok(false),
    };
    let batch: Vec<Decoded> = events.iter().map(Decoded::from).collect();
    match fold(log, projection, applied, &batch).await {
        Ok(_) | Err(ProjectionError::Gap { .. }) => Ok(true),
        Err(e) => Err(e),
    }
}

/// Rebuilds a projection of the whole log from sequence 0 in `dir` (which must be empty or
/// absent) and returns its digest and counts.
pub async fn replay<L: EventLog>(
    log: &L,
    dir: &Path,
    config: StateConfig,
) -> Result<(String, Stats, u64), ProjectionError> {
    let mut p = Projector::open(dir, config, log).await?;
    p.catch_up(log).await?;
    Ok((p.digest()?, p.stats(), p.last_seq()))
}
