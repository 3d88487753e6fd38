//! Where workload rows are stored: one key each while a workload lives, a few dozen to a key
//! once they have ended.
//!
//! sled 0.34 keeps a few hundred bytes in memory for every page of at most 16 keys, cached or
//! not, so one key per workload ever submitted made the projection's memory grow with history
//! (about 48 bytes a workload: 151 MB at 3.4 million). Rows are therefore written as singles
//! (`w/<id>`, the row's postcard) and, once a run of them has ended, gathered into packs
//! (`x/<first id>`, the ids and the same rows' bytes, at most [`PACK_ROWS`] or about
//! [`PACK_BYTES`]); a row that ends in the batch that packs its run goes straight into its pack
//! (catching up, in large batches, most rows are written once). A position, `through`, divides
//! the two: past it every row is a single; up to it every ended row is in a pack, except those
//! still live when packing went past them (a workload waiting longer than [`PACK_LAG`] events
//! does not hold packing back), which stay singles when they end. A packed row changes only
//! when an event about it is refused, in place in its pack.
//!
//! Packing moves rows without changing them: readers see rows in id order whichever way they
//! are stored ([`Rows`]), and the digest hashes that order, so a projection packed at other
//! moments, or not yet, has the same digest. A pack is written in one sled batch with the
//! removal of the singles it takes and the new position, so a crash leaves each row in exactly
//! one place.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ops::Bound;

use ledger::WorkloadId;
use serde::{Deserialize, Serialize};

use crate::{Fault, WorkloadRow};

/// The rows and keys of the batch being written behind the fold ([`crate::behind`]), as the fold
/// would read them from the tree.
#[derive(Default)]
pub(crate) struct Overlay {
    pub(crate) rows: HashMap<WorkloadId, (Vec<u8>, Place)>,
    pub(crate) keys: HashMap<Vec<u8>, Vec<u8>>,
}

/// Prefix of single rows.
pub(crate) const SINGLE: &[u8] = b"w/";
/// Past every single row's key.
const SINGLE_END: &[u8] = b"w0";
/// Prefix of packs.
const PACKED: &[u8] = b"x/";
/// Past every pack's key: where the keys after the workload rows begin.
pub(crate) const AFTER_ROWS: &[u8] = b"x0";
const PACKED_END: &[u8] = AFTER_ROWS;
/// The meta row holding `through`: where rows are stored, not what they are, so not in the
/// digest.
pub(crate) const THROUGH: &[u8] = b"m/packed_through";
/// Most rows in a pack.
pub const PACK_ROWS: usize = 64;
/// A pack takes no more rows once they hold this many bytes (a leaf of 16 packs stays small
/// enough for sled to rewrite cheaply).
pub const PACK_BYTES: usize = 4096;
/// A live workload submitted more than this many events ago no longer holds packing back: it
/// stays a single and packing goes on past it.
pub const PACK_LAG: u64 = 100_000;
/// Ended rows written past the packing position before packing runs again.
pub(crate) const ENDINGS_PER_RUN: usize = 32;
/// Live rows passed while gathering one pack before it is closed short (so rescanning a
/// partly gathered pack stays cheap).
const SKIPS_PER_PACK: usize = 16;
/// Packs written by one packing at most.
const PACKS_PER_RUN: usize = 64;
/// Rows looked at by one packing at most (it runs while the fold waits).
const ROWS_PER_RUN: usize = 8192;

/// A pack as stored: its rows' ids, ascending, and their bytes.
#[derive(Serialize, Deserialize)]
struct Pack<'a> {
    ids: Vec<WorkloadId>,
    #[serde(borrow)]
    rows: Vec<&'a [u8]>,
}

impl<'a> Pack<'a> {
    fn decode(key: &[u8], bytes: &'a [u8]) -> Result<Pack<'a>, Fault> {
        let pack: Pack = postcard::from_bytes(bytes)
            .map_err(|e| Fault::Corrupt(format!("workload pack {key:?}: {e}")))?;
        if pack.ids.len() != pack.rows.len() || pack.ids.is_empty() {
            return Err(Fault::Corrupt(format!(
                "workload pack {key:?} has {} ids and {} rows",
                pack.ids.len(),
                pack.rows.len()
            )));
        }
        Ok(pack)
    }
}

pub(crate) fn single_key(id: WorkloadId) -> Vec<u8> {
    key(SINGLE, id)
}

fn packed_key(id: WorkloadId) -> Vec<u8> {
    key(PACKED, id)
}

fn key(prefix: &[u8], id: WorkloadId) -> Vec<u8> {
    crate::prefixed(prefix, id.as_bytes())
}

fn id_of(key: &[u8]) -> Result<WorkloadId, Fault> {
    key.get(2..)
        .and_then(|b| WorkloadId::from_slice(b).ok())
        .ok_or_else(|| Fault::Corrupt(format!("bad workload key {key:?}")))
}

/// Reads the stored `through`.
pub(crate) fn through(tree: &sled::Tree) -> Result<Option<WorkloadId>, Fault> {
    tree.get(THROUGH)?
        .map(|v| {
            WorkloadId::from_slice(&v).map_err(|_| Fault::Corrupt("bad packing position".into()))
        })
        .transpose()
}

/// Where a stored row is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Place {
    Single,
    /// In the pack with this key.
    Packed(Vec<u8>),
}

/// Workload `id`'s stored row (its postcard) and where it is. `through`, when known, spares
/// looking in packs for rows past it (`None` looks wherever).
pub(crate) fn find(
    tree: &sled::Tree,
    id: WorkloadId,
    through: Option<Option<WorkloadId>>,
) -> Result<Option<(Vec<u8>, Place)>, Fault> {
    if let Some(v) = tree.get(single_key(id))? {
        return Ok(Some((v.to_vec(), Place::Single)));
    }
    match through {
        Some(None) => return Ok(None),
        Some(Some(t)) if id > t => return Ok(None),
        _ => {}
    }
    let Some(entry) = tree.range(PACKED.to_vec()..=packed_key(id)).next_back() else {
        return Ok(None);
    };
    let (k, v) = entry?;
    let pack = Pack::decode(&k, &v)?;
    Ok(pack
        .ids
        .binary_search(&id)
        .ok()
        .map(|i| (pack.rows[i].to_vec(), Place::Packed(k.to_vec()))))
}

/// Replaces rows in the pack at `key` (each of the ids must be in it) by adding the rewritten
/// pack to `batch`.
pub(crate) fn rewrite(
    tree: &sled::Tree,
    key: &[u8],
    rows: &[(WorkloadId, Vec<u8>)],
    batch: &mut sled::Batch,
) -> Result<(), Fault> {
    let stored = tree
        .get(key)?
        .ok_or_else(|| Fault::Corrupt(format!("workload pack {key:?} vanished")))?;
    let mut pack = Pack::decode(key, &stored)?;
    for (id, bytes) in rows {
        let i = pack.ids.binary_search(id).map_err(|_| {
            Fault::Corrupt(format!(
                "workload {id} is not in the pack {key:?} it was read from"
            ))
        })?;
        pack.rows[i] = bytes;
    }
    batch.insert(
        key,
        postcard::to_stdvec(&pack).expect("packs always serialize"),
    );
    Ok(())
}

/// Rows in id order, ascending or descending, merging singles and packs.
pub(crate) struct Rows {
    singles: sled::Iter,
    packs: sled::Iter,
    descending: bool,
    /// Descending from below this id (packs may hold rows at or past it).
    below: Option<WorkloadId>,
    single: Option<(WorkloadId, sled::IVec)>,
    packed: VecDeque<(WorkloadId, Vec<u8>)>,
}

impl Rows {
    /// Every row, ascending.
    pub(crate) fn ascending(tree: &sled::Tree) -> Rows {
        Rows {
            singles: tree.range(SINGLE.to_vec()..SINGLE_END.to_vec()),
            packs: tree.range(PACKED.to_vec()..PACKED_END.to_vec()),
            descending: false,
            below: None,
            single: None,
            packed: VecDeque::new(),
        }
    }

    /// The rows before `below` (all when `None`), descending.
    pub(crate) fn descending(tree: &sled::Tree, below: Option<WorkloadId>) -> Rows {
        let (single_end, packed_end) = match below {
            Some(id) => (single_key(id), packed_key(id)),
            None => (SINGLE_END.to_vec(), PACKED_END.to_vec()),
        };
        Rows {
            singles: tree.range(SINGLE.to_vec()..single_end),
            packs: tree.range(PACKED.to_vec()..packed_end),
            descending: true,
            below,
            single: None,
            packed: VecDeque::new(),
        }
    }

    fn step(&mut self, packs: bool) -> Option<sled::Result<(sled::IVec, sled::IVec)>> {
        let it = if packs {
            &mut self.packs
        } else {
            &mut self.singles
        };
        if self.descending {
            it.next_back()
        } else {
            it.next()
        }
    }

    fn fill(&mut self) -> Result<(), Fault> {
        if self.single.is_none() {
            if let Some(entry) = self.step(false) {
                let (k, v) = entry?;
                self.single = Some((id_of(&k)?, v));
            }
        }
        while self.packed.is_empty() {
            let Some(entry) = self.step(true) else {
                break;
            };
            let (k, v) = entry?;
            let pack = Pack::decode(&k, &v)?;
            let rows = pack
                .ids
                .iter()
                .zip(&pack.rows)
                .filter(|(id, _)| self.below.is_none_or(|b| **id < b))
                .map(|(id, r)| (*id, r.to_vec()));
            if self.descending {
                self.packed.extend(rows.rev());
            } else {
                self.packed.extend(rows);
            }
        }
        Ok(())
    }
}

impl Iterator for Rows {
    type Item = Result<(WorkloadId, Vec<u8>), Fault>;

    fn next(&mut self) -> Option<Self::Item> {
        if let Err(e) = self.fill() {
            return Some(Err(e));
        }
        let take_single = match (&self.single, self.packed.front()) {
            (None, None) => return None,
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (Some((s, _)), Some((p, _))) => (s > p) == self.descending,
        };
        Some(Ok(if take_single {
            let (id, v) = self.single.take().expect("a single to take");
            (id, v.to_vec())
        } else {
            self.packed.pop_front().expect("a packed row to take")
        }))
    }
}

/// Whether any row is stored before `id`.
pub(crate) fn any_before(tree: &sled::Tree, id: WorkloadId) -> Result<bool, Fault> {
    Ok(tree
        .range(SINGLE.to_vec()..single_key(id))
        .next_back()
        .transpose()?
        .is_some()
        || tree
            .range(PACKED.to_vec()..packed_key(id))
            .next_back()
            .transpose()?
            .is_some())
}

/// How many single rows and packs are stored.
pub(crate) fn count(tree: &sled::Tree) -> Result<(usize, usize), Fault> {
    let keys = |from: &[u8], to: &[u8]| -> Result<usize, Fault> {
        let mut n = 0;
        for k in tree.range(from.to_vec()..to.to_vec()).keys() {
            k?;
            n += 1;
        }
        Ok(n)
    };
    Ok((keys(SINGLE, SINGLE_END)?, keys(PACKED, PACKED_END)?))
}

/// A row the batch being folded is about to write, past the packing position.
pub(crate) struct Fresh {
    pub(crate) bytes: Vec<u8>,
    pub(crate) ended: bool,
    pub(crate) submit_seq: u64,
}

/// A gathered row's bytes: a stored single's, or a fresh row's, borrowed.
enum Bytes<'a> {
    Stored(sled::IVec),
    Fresh(&'a [u8]),
}

impl std::ops::Deref for Bytes<'_> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Stored(v) => v,
            Bytes::Fresh(b) => b,
        }
    }
}

/// A pack being gathered.
#[derive(Default)]
struct Gathering<'a> {
    ids: Vec<WorkloadId>,
    rows: Vec<Bytes<'a>>,
    /// Whether each row is stored as a single (to be removed), not only fresh.
    stored: Vec<bool>,
    bytes: usize,
    /// Live rows passed since it was begun.
    skipped: usize,
}

impl Gathering<'_> {
    fn full(&self) -> bool {
        self.ids.len() >= PACK_ROWS || self.bytes >= PACK_BYTES
    }

    /// Writes the pack and the removal of its stored singles into `batch`; notes the fresh
    /// rows it took in `taken`.
    fn close(
        &mut self,
        batch: &mut sled::Batch,
        taken: &mut Vec<WorkloadId>,
        overlay: Option<&mut Overlay>,
    ) {
        let gathered = std::mem::take(self);
        let key = packed_key(gathered.ids[0]);
        if let Some(overlay) = overlay {
            for (id, row) in gathered.ids.iter().zip(&gathered.rows) {
                let place = Place::Packed(key.clone());
                overlay.rows.insert(*id, (row.to_vec(), place));
            }
        }
        for (id, stored) in gathered.ids.iter().zip(&gathered.stored) {
            if *stored {
                batch.remove(single_key(*id));
            }
        }
        // The fresh rows packed here are not to be written as singles as well.
        taken.extend(
            gathered
                .ids
                .iter()
                .zip(&gathered.rows)
                .filter(|(_, r)| matches!(r, Bytes::Fresh(_)))
                .map(|(id, _)| *id),
        );
        let pack = Pack {
            ids: gathered.ids,
            rows: gathered.rows.iter().map(|r| &r[..]).collect(),
        };
        batch.insert(
            key,
            postcard::to_stdvec(&pack).expect("packs always serialize"),
        );
    }
}

/// Where a packing starts: the position, the fold's sequence, the lag, and whether the run is
/// bounded.
pub(crate) struct At {
    pub(crate) through: Option<WorkloadId>,
    pub(crate) last_seq: u64,
    pub(crate) lag: u64,
    pub(crate) bounded: bool,
}

/// What one packing wrote: the new position.
pub(crate) struct Packing {
    pub(crate) through: WorkloadId,
    /// Rows moved into packs.
    pub(crate) packed: usize,
    /// It stopped at a run's bounds, not at a live workload or the last row: there is more to
    /// pack now.
    pub(crate) more: bool,
}

/// Gathers the ended rows past `through` into packs, as of the fold at `last_seq`, adding them
/// to `batch`: the stored singles merged with the `fresh` rows the batch is about to write
/// (which replace stored ones of the same id, and which go straight into packs, taken out of
/// `fresh`, rather than be written as singles and moved later). It goes up to the first live
/// workload submitted within `lag` events ([`PACK_LAG`]; older live ones are passed and stay
/// singles) and, when `bounded` (a fold others wait on), within a run's bounds. `None` when
/// the position would not move.
pub(crate) fn gather(
    tree: &sled::Tree,
    at: At,
    fresh: &mut BTreeMap<WorkloadId, Fresh>,
    batch: &mut sled::Batch,
    mut overlay: Option<&mut Overlay>,
) -> Result<Option<Packing>, Fault> {
    let At {
        through,
        last_seq,
        lag,
        bounded,
    } = at;
    let start = match through {
        Some(id) => Bound::Excluded(single_key(id)),
        None => Bound::Included(SINGLE.to_vec()),
    };
    let mut stored = tree
        .range((start, Bound::Excluded(SINGLE_END.to_vec())))
        .peekable();
    let past = match through {
        Some(id) => Bound::Excluded(id),
        None => Bound::Unbounded,
    };
    let mut fresh_rows = fresh.range((past, Bound::Unbounded)).peekable();
    let mut gathering = Gathering::default();
    let mut taken = Vec::new();
    let mut moved = through;
    let (mut looked, mut packs, mut packed, mut more) = (0, 0, 0, false);
    loop {
        if bounded && (looked >= ROWS_PER_RUN || packs >= PACKS_PER_RUN) {
            more = true;
            break;
        }
        // The next row in id order, fresh before stored of the same id.
        let stored_id = match stored.peek() {
            None => None,
            Some(Ok((k, _))) => Some(id_of(k)?),
            Some(Err(_)) => return Err(stored.next().expect("peeked").unwrap_err().into()),
        };
        let fresh_id = fresh_rows.peek().map(|(id, _)| **id);
        let (id, bytes, ended, submit_seq, was_stored) = match (stored_id, fresh_id) {
            (None, None) => break,
            (Some(s), f) if f.is_none_or(|f| s < f) => {
                let (_, v) = stored.next().expect("peeked")?;
                let row: WorkloadRow = postcard::from_bytes(&v)
                    .map_err(|e| Fault::Corrupt(format!("workload row {s}: {e}")))?;
                (
                    s,
                    Bytes::Stored(v),
                    row.ended_at_ms.is_some(),
                    row.submit_seq,
                    true,
                )
            }
            (s, _) => {
                let (id, f) = fresh_rows.next().expect("peeked");
                let replaces = s == Some(*id);
                if replaces {
                    stored.next();
                }
                (*id, Bytes::Fresh(&f.bytes), f.ended, f.submit_seq, replaces)
            }
        };
        looked += 1;
        let close = if ended {
            gathering.bytes += bytes.len();
            gathering.ids.push(id);
            gathering.rows.push(bytes);
            gathering.stored.push(was_stored);
            gathering.full()
        } else if last_seq.saturating_sub(submit_seq) > lag {
            if gathering.ids.is_empty() {
                moved = Some(id);
                false
            } else {
                gathering.skipped += 1;
                gathering.skipped >= SKIPS_PER_PACK
            }
        } else {
            break;
        };
        if close {
            packed += gathering.ids.len();
            gathering.close(batch, &mut taken, overlay.as_deref_mut());
            packs += 1;
            moved = Some(id);
        }
    }
    for id in &taken {
        fresh.remove(id);
    }
    let Some(to) = moved.filter(|&m| Some(m) != through) else {
        return Ok(None);
    };
    batch.insert(THROUGH, to.as_bytes());
    Ok(Some(Packing {
        through: to,
        packed,
        more,
    }))
}
