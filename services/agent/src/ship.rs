//! Shipping runs' output: every run directory's `output.log` is read from where the server's
//! copy ends and sent a chunk at a time as it grows, so a researcher reads it over the API
//! (`GET /v1/workloads/{id}/logs`) from anywhere, while the run goes on and after it ended.
//!
//! Where the server's copy ends is asked once per run (so a restarted agent goes on where the
//! last one stopped, and nothing is shipped twice); once a run ended and all of its output is
//! shipped, the last chunk says so and a `shipped` file in the run directory keeps the agent from
//! looking at it again.

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use eventlog::output::{AnyOutput, Chunk, OutputStore, RunKey, Shipped, CHUNK_MAX};
use uuid::Uuid;

use crate::http::HttpLog;
use crate::run;

/// How often new output is looked for.
pub const SHIP_EVERY: Duration = Duration::from_millis(500);

/// The most bytes of one run shipped per look: a run that writes faster is shipped over the
/// next looks, and others' output is not held up behind it.
const PER_LOOK: u64 = 64 * CHUNK_MAX as u64;

/// A run whose unshipped output grows past this is shipped from its last this many bytes on:
/// the service keeps no more of a run (its default bound), so shipping older bytes would only
/// have them dropped. Readers see the gap as output not kept.
const BEHIND_MAX: u64 = 16 << 20;

/// Where output goes.
#[derive(Clone)]
pub enum Shipping {
    /// Straight into a store: the embedded one of a server the agent lives in, or the `OUTPUT`
    /// stream on NATS.
    Store(AnyOutput),
    /// To a server's API (`POST /v1/nodes/{node}/output/{workload}/{run}`).
    Http(HttpLog),
    /// Nowhere.
    Off,
}

impl Shipping {
    async fn shipped(&self, key: &RunKey) -> Result<Option<Shipped>, String> {
        match self {
            Shipping::Store(s) => s.shipped(key).await.map_err(|e| e.to_string()),
            Shipping::Http(h) => h.output_shipped(key).await,
            Shipping::Off => Ok(None),
        }
    }

    async fn append(&self, key: &RunKey, chunk: Chunk) -> Result<(), String> {
        match self {
            Shipping::Store(s) => s.append(key, chunk).await.map_err(|e| e.to_string()),
            Shipping::Http(h) => h.ship_output(key, chunk).await,
            Shipping::Off => Ok(()),
        }
    }
}

/// What the shipper keeps of one run.
struct Shipment {
    key: RunKey,
    /// The next byte to ship; `None` until the server's copy was asked about.
    next: Option<u64>,
}

/// The shipper of one node's runs.
pub struct Shipper {
    shipping: Shipping,
    runs_dir: PathBuf,
    node: String,
    runs: BTreeMap<PathBuf, Shipment>,
    /// The last failure said, so a server that stays away is not said every second.
    said: Option<String>,
}

/// The run directory `name` stands for (`<workload>-<run>`).
fn parse_dir(name: &str) -> Option<(Uuid, u64)> {
    let (workload, run) = name.rsplit_once('-')?;
    Some((Uuid::parse_str(workload).ok()?, run.parse().ok()?))
}

/// Up to `max` bytes of `path` from `offset`: what was written since.
fn read_from(path: &Path, offset: u64, max: u64) -> std::io::Result<Vec<u8>> {
    let mut f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    f.seek(SeekFrom::Start(offset))?;
    let mut out = Vec::new();
    f.take(max).read_to_end(&mut out)?;
    Ok(out)
}

impl Shipper {
    /// A shipper of the runs in `runs_dir` of `node`.
    pub fn new(shipping: Shipping, runs_dir: PathBuf, node: String) -> Self {
        Shipper {
            shipping,
            runs_dir,
            node,
            runs: BTreeMap::new(),
            said: None,
        }
    }

    /// Ships what is new every [`SHIP_EVERY`] until `stop` resolves, then once more.
    pub async fn run(mut self, stop: impl std::future::Future<Output = ()>) {
        if matches!(self.shipping, Shipping::Off) {
            return;
        }
        let mut stop = std::pin::pin!(stop);
        let mut tick = tokio::time::interval(SHIP_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = &mut stop => {
                    self.look().await;
                    return;
                }
                _ = tick.tick() => self.look().await,
            }
        }
    }

    /// Looks at every run not shipped whole yet and ships what is new.
    pub async fn look(&mut self) {
        let entries = match std::fs::read_dir(&self.runs_dir) {
            Ok(entries) => entries,
            Err(_) => return,
        };
        let mut seen = Vec::new();
        for entry in entries.flatten() {
            let dir = entry.path();
            let Some((workload, run)) = entry.file_name().to_str().and_then(parse_dir) else {
                continue;
            };
            if dir.join("shipped").exists() {
                self.runs.remove(&dir);
                continue;
            }
            seen.push(dir.clone());
            let node = self.node.clone();
            self.runs.entry(dir).or_insert_with(|| Shipment {
                key: RunKey {
                    workload,
                    run,
                    node,
                },
                next: None,
            });
        }
        for dir in seen {
            if let Err(e) = self.ship(&dir).await {
                if self.said.as_deref() != Some(e.as_str()) {
                    tracing::warn!(error = %e, "cannot ship a run's output; trying again");
                    self.said = Some(e);
                }
                return;
            }
        }
        self.said = None;
    }

    /// Ships what is new of the run in `dir`; marks it shipped once it ended and all is.
    async fn ship(&mut self, dir: &Path) -> Result<(), String> {
        let Some(shipment) = self.runs.get_mut(dir) else {
            return Ok(());
        };
        let next = match shipment.next {
            Some(next) => next,
            None => match self.shipping.shipped(&shipment.key).await? {
                Some(Shipped { ended: true, .. }) => return mark_shipped(dir),
                Some(s) => *shipment.next.insert(s.next_offset),
                None => *shipment.next.insert(0),
            },
        };
        // Ended first, read after: all a run wrote is in its log before its end is recorded.
        let ended = !matches!(run::status(dir), run::Status::Running);
        let path = dir.join("output.log");
        let written = std::fs::metadata(&path).map_or(0, |m| m.len());
        let next = if written > next + BEHIND_MAX {
            let from = written - BEHIND_MAX;
            tracing::warn!(workload = %shipment.key.workload, run = shipment.key.run, "a run writes faster than its output is shipped: {} bytes are skipped", from - next);
            from
        } else {
            next
        };
        let new =
            read_from(&path, next, PER_LOOK).map_err(|e| format!("{}: {e}", path.display()))?;
        let drained = (new.len() as u64) < PER_LOOK;
        let mut offset = next;
        let mut pieces = new.chunks(CHUNK_MAX).peekable();
        while let Some(piece) = pieces.next() {
            let last = ended && drained && pieces.peek().is_none();
            let chunk = Chunk {
                offset,
                data: Bytes::copy_from_slice(piece),
                end: last,
                at_ms: crate::wall_clock_ms(),
            };
            self.shipping.append(&shipment.key, chunk).await?;
            offset += piece.len() as u64;
            shipment.next = Some(offset);
            if last {
                return mark_shipped(dir);
            }
        }
        if ended && drained {
            // Nothing more was written: the end, on its own.
            let end = Chunk {
                offset,
                data: Bytes::new(),
                end: true,
                at_ms: crate::wall_clock_ms(),
            };
            self.shipping.append(&shipment.key, end).await?;
            return mark_shipped(dir);
        }
        Ok(())
    }
}

fn mark_shipped(dir: &Path) -> Result<(), String> {
    std::fs::write(dir.join("shipped"), b"")
        .map_err(|e| format!("cannot write {}: {e}", dir.join("shipped").display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_directories_name_their_workload_and_run() {
        let id = Uuid::from_u128(42);
        assert_eq!(parse_dir(&format!("{id}-3")), Some((id, 3)));
        assert_eq!(parse_dir("notes"), None);
        assert_eq!(parse_dir(&format!("{id}-x")), None);
    }

    #[tokio::test]
    async fn a_run_is_shipped_as_it_grows_and_marked_once_it_ended_and_all_is_shipped() {
        let tmp = tempfile::tempdir().unwrap();
        let db = tempfile::tempdir().unwrap();
        let log = eventlog::EmbeddedLog::open(db.path()).unwrap();
        let store = log.output(Default::default()).unwrap();
        let id = Uuid::from_u128(7);
        let dir = run::dir(tmp.path(), id, 1);
        std::fs::create_dir(&dir).unwrap();
        let mut shipper = Shipper::new(
            Shipping::Store(AnyOutput::Embedded(store.clone())),
            tmp.path().into(),
            "n1".into(),
        );
        let key = RunKey {
            workload: id,
            run: 1,
            node: "n1".into(),
        };
        std::fs::write(dir.join("output.log"), "one\n").unwrap();
        // No exit recorded and no live process: lost, so it ends with what it has.
        shipper.look().await;
        let kept = store.shipped(&key).await.unwrap().unwrap();
        assert_eq!(
            kept,
            Shipped {
                next_offset: 4,
                ended: true
            }
        );
        assert!(dir.join("shipped").exists());
        // A second run, shipped in pieces larger than a chunk, resumed by a new shipper.
        let dir2 = run::dir(tmp.path(), id, 2);
        std::fs::create_dir(&dir2).unwrap();
        let big = "x".repeat(CHUNK_MAX * 2 + 10);
        std::fs::write(dir2.join("output.log"), &big).unwrap();
        std::fs::write(
            dir2.join("exit.json"),
            r#"{"exit_code":0,"signal":null,"ended_at_ms":1}"#,
        )
        .unwrap();
        let key2 = RunKey { run: 2, ..key };
        store
            .append(
                &key2,
                Chunk {
                    offset: 0,
                    data: Bytes::copy_from_slice(&big.as_bytes()[..100]),
                    end: false,
                    at_ms: crate::wall_clock_ms(),
                },
            )
            .await
            .unwrap();
        let mut again = Shipper::new(
            Shipping::Store(AnyOutput::Embedded(store.clone())),
            tmp.path().into(),
            "n1".into(),
        );
        again.look().await;
        let mut text = Vec::new();
        let mut cursor = 0;
        loop {
            let page = store.read(&key2, cursor, 1 << 20).await.unwrap();
            if page.chunks.is_empty() {
                break;
            }
            for c in &page.chunks {
                assert_eq!(c.offset as usize, text.len(), "no gap, no repeat");
                text.extend_from_slice(&c.data);
            }
            cursor = page.cursor;
        }
        assert_eq!(text, big.as_bytes());
        assert!(store.shipped(&key2).await.unwrap().unwrap().ended);
    }
}
