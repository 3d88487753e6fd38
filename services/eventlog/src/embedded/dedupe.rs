//! Idempotency keys by numbered duplicate window, in the log's own tree.

use super::*;

/// Idempotency keys by numbered duplicate window: `k<window number><key>` holds the key's
/// sequence. A key is looked up in the current window and the one before; older windows are
/// expired.
pub(super) struct Dedupe {
    window_s: u64,
    /// The windows that hold keys.
    windows: std::collections::BTreeSet<u32>,
}

impl Dedupe {
    pub(super) fn open(tree: &sled::Tree, window: std::time::Duration) -> sled::Result<Self> {
        let mut windows = std::collections::BTreeSet::new();
        let mut from = 0u32;
        loop {
            let Some(entry) = tree.range(dedupe_key(from, "")..).next() else {
                break;
            };
            let (k, _) = entry?;
            let Some(n) = (k.first() == Some(&b'k'))
                .then(|| k.get(1..5))
                .flatten()
                .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
            else {
                break;
            };
            windows.insert(n);
            match n.checked_add(1) {
                Some(after) => from = after,
                None => break,
            }
        }
        Ok(Dedupe {
            window_s: window.as_secs().max(1),
            windows,
        })
    }

    /// The number of the window under way: never lower than one already used, so a clock
    /// stepped back does not file keys where lookups would no longer look.
    pub(super) fn now(&self) -> u32 {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let now = (secs / self.window_s).min(u64::from(u32::MAX)) as u32;
        now.max(self.windows.last().copied().unwrap_or(0))
    }

    pub(super) fn note(&mut self, window: u32) {
        self.windows.insert(window);
    }

    /// The sequence of the append that used `id`, if it is remembered in window `now`.
    pub(super) fn find(&self, tree: &sled::Tree, now: u32, id: &str) -> sled::Result<Option<u64>> {
        for &w in self.windows.iter().rev() {
            if w.saturating_add(1) < now {
                break;
            }
            if let Some(v) = tree.get(dedupe_key(w, id))? {
                return Ok(u64_of(&v));
            }
        }
        Ok(None)
    }

    /// Adds to `batch` the deletion of some keys of the oldest window if it has expired.
    pub(super) fn expire(&mut self, tree: &sled::Tree, now: u32, batch: &mut sled::Batch) {
        let Some(&oldest) = self.windows.first() else {
            return;
        };
        if oldest.saturating_add(1) >= now {
            return;
        }
        let prefix = dedupe_key(oldest, "");
        let mut n = 0;
        for k in tree.scan_prefix(&prefix).keys().take(EXPIRE_PER_GROUP) {
            match k {
                Ok(k) => {
                    batch.remove(k);
                    n += 1;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "reading expired idempotency keys");
                    return;
                }
            }
        }
        if n < EXPIRE_PER_GROUP {
            // Its last keys go with this batch.
            self.windows.remove(&oldest);
        }
    }
}

pub(super) fn dedupe_key(window: u32, id: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(5 + id.len());
    k.push(b'k');
    k.extend_from_slice(&window.to_be_bytes());
    k.extend_from_slice(id.as_bytes());
    k
}
