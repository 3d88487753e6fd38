//! Converting a log kept the old way (one key per event, idempotency keys kept for ever) into
//! blocks, beside it, and putting the result in its place: interrupted anywhere, the next
//! start finishes or clears it.

use super::*;

/// Where a log being converted is written, beside its directory.
pub(super) fn converting(dir: &Path) -> PathBuf {
    dir.with_extension("converting")
}

/// Where a converted log's old directory waits to be deleted.
pub(super) fn converted(dir: &Path) -> PathBuf {
    dir.with_extension("converted")
}

/// Writes the log in `dir`, kept with one key per event (`e<seq>`) and idempotency keys kept
/// for ever (`d<key>`), as blocks into a directory beside it, which [`put_converted_in_place`]
/// puts in its place: sled does not give back the memory of pages emptied in place, so the
/// converted log starts afresh. The idempotency keys are not carried over (a window's worth
/// of retries after an upgrade is all they would catch).
pub(super) fn convert_per_event_keys(dir: &Path, tree: &sled::Tree) -> Result<(), LogError> {
    let unavailable = |e: sled::Error| LogError::Unavailable(e.to_string());
    let io = |e: std::io::Error| LogError::Unavailable(e.to_string());
    let to = converting(dir);
    if to.exists() {
        std::fs::remove_dir_all(&to).map_err(io)?;
    }
    tracing::info!(dir = %dir.display(), "converting the event log to blocks of events (once)");
    let db = open_sled(sled::Config::new().path(&to)).map_err(unavailable)?;
    let out = db.open_tree("log").map_err(unavailable)?;
    let mut batch = sled::Batch::default();
    let mut block = Block::starting(1);
    let mut written = 0;
    for entry in tree.scan_prefix(b"e") {
        let (k, v) = entry.map_err(unavailable)?;
        let seq = seq_of_key(&k).ok_or_else(|| LogError::Corrupt {
            seq: 0,
            reason: "bad event key".into(),
        })?;
        decode(seq, &v)?;
        if block.add(seq, &v, &mut batch) {
            written += 1;
            if written % (CONVERT_CHUNK / BLOCK_EVENTS) == 0 {
                out.apply_batch(std::mem::take(&mut batch))
                    .map_err(unavailable)?;
            }
        }
    }
    block.write_to(&mut batch);
    for entry in tree.scan_prefix(b"s") {
        let (k, v) = entry.map_err(unavailable)?;
        batch.insert(k, v);
    }
    out.apply_batch(batch).map_err(unavailable)?;
    db.flush().map_err(unavailable)?;
    let mark = dir.join(HIGH_WATER);
    if mark.exists() {
        std::fs::copy(&mark, to.join(HIGH_WATER)).map_err(io)?;
        std::fs::File::open(to.join(HIGH_WATER))
            .and_then(|f| f.sync_all())
            .map_err(io)?;
    }
    std::fs::write(to.join(CONVERTED), b"blocks\n")
        .and_then(|()| std::fs::File::open(to.join(CONVERTED))?.sync_all())
        .and_then(|()| sync_dir(&to))
        .map_err(io)?;
    // Complete: the old directory steps aside, and the new one takes its place.
    std::fs::rename(dir, converted(dir))
        .and_then(|()| sync_dir(dir))
        .map_err(io)
}

/// The file a converted log's directory holds, once the conversion is complete.
pub(super) const CONVERTED: &str = "converted";

/// Makes the entries of `path`'s parent directory (a rename) durable.
pub(super) fn sync_dir(path: &Path) -> std::io::Result<()> {
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::File::open(parent)?.sync_all()
}

/// Puts a complete conversion in place of the old directory that stepped aside for it (a
/// crash between the two renames). Runs before the directory's lock can be taken: it touches
/// nothing while the directory exists.
pub(super) fn put_converted_in_place(dir: &Path) -> std::io::Result<()> {
    let (to, old) = (converting(dir), converted(dir));
    if dir.exists() || !old.exists() {
        return Ok(());
    }
    if !to.join(CONVERTED).exists() {
        return Err(std::io::Error::other(format!(
            "the log was being converted and its new copy {} is not complete; move {} back to {}",
            to.display(),
            old.display(),
            dir.display()
        )));
    }
    std::fs::rename(&to, dir)?;
    sync_dir(dir)
}

/// Deletes what a conversion left behind: a new copy never completed, or the old directory once
/// the converted one is in place. Only with the directory's lock held.
pub(super) fn clear_conversion_leftovers(dir: &Path) -> std::io::Result<()> {
    let (to, old) = (converting(dir), converted(dir));
    if to.exists() {
        std::fs::remove_dir_all(&to)?;
    }
    if old.exists() {
        if !dir.join(CONVERTED).exists() {
            return Err(std::io::Error::other(format!(
                "{} is a log set aside by a conversion, but {} is not the converted one; keep the one that holds the ledger and move the other away",
                old.display(),
                dir.display()
            )));
        }
        std::fs::remove_dir_all(&old)?;
    }
    Ok(())
}
