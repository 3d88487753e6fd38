//! Notifications: the events of a workload (started, preemption requested, stopped, requeued,
//! finished, cancelled) posted to the URL it names, or its submitter's default, as the ledger's
//! JSON, signed with its submitter's secret, at least once and in order.
//!
//! The notifier follows the log on its own, in the process that runs the scheduler, and keeps
//! what it owes in a sled database of its own (`DATA/notify`): where it stands in the log, the
//! workloads with a URL, the deliveries due (a workload's one at a time, oldest first) and each
//! workload's delivery state, shown on `GET /v1/workloads/{id}`. A delivery that fails is tried
//! again after 1, 2, 4… seconds (at most 10 minutes apart) for a day, then given up and said.
//!
//! Signing: each principal has a secret, derived from the service's key (`DATA/notify.key`,
//! or `serve --notify-key-file`, the same file for every process of one ledger) and its grant,
//! and shown once when its token is made. A delivery carries
//! `X-Fairledger-Signature-256: sha256=<hex HMAC-SHA256 of the body, keyed by the secret>`,
//! `X-Fairledger-Event` (its kind) and `X-Fairledger-Delivery` (the event's id, to drop
//! repeats). Redirects are not followed, so the allowed prefixes are the only places posted to.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use eventlog::EventLog;
use ledger::identity::Principal;
use ledger::{Envelope, Event};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::App;

/// Deliveries in flight at once.
const IN_FLIGHT: usize = 8;
/// How long one delivery may take.
const POST_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest wait between two tries.
const BACKOFF_MAX_MS: u64 = 10 * 60_000;
/// A delivery not made within this is given up.
const GIVE_UP_AFTER_MS: u64 = 86_400_000;

/// The service's key for notification secrets: 32 random bytes, hex in `path` (made, readable
/// by its owner only, when missing).
pub fn load_or_make_key(path: &Path) -> Result<[u8; 32], String> {
    let parse = |text: &str| -> Option<[u8; 32]> {
        let text = text.trim();
        if text.len() != 64 {
            return None;
        }
        let mut key = [0u8; 32];
        for (i, byte) in key.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(key)
    };
    match std::fs::read_to_string(path) {
        Ok(text) => parse(&text).ok_or_else(|| {
            format!(
                "{} does not hold a notification key (64 hex digits); delete it to make a new one (every principal's notification secret changes)",
                path.display()
            )
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let mut key = [0u8; 32];
            getrandom::fill(&mut key).map_err(|e| format!("no randomness: {e}"))?;
            let text: String = key.iter().map(|b| format!("{b:02x}")).collect();
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(path)
                .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
            f.write_all(text.as_bytes())
                .and_then(|_| f.sync_all())
                .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
            Ok(key)
        }
        Err(e) => Err(format!("cannot read {}: {e}", path.display())),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `principal`'s notification secret under `key`: it changes when the principal is granted
/// again.
pub fn secret(key: &[u8; 32], principal: &Principal) -> String {
    let k = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key);
    let what = format!(
        "fairledger-notify:{}:{}",
        principal.name, principal.granted_seq
    );
    hex(ring::hmac::sign(&k, what.as_bytes()).as_ref())
}

/// The signature header's value of `body` under `secret`: `sha256=<hex>`.
pub fn signature(secret: &str, body: &[u8]) -> String {
    let k = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret.as_bytes());
    format!("sha256={}", hex(ring::hmac::sign(&k, body).as_ref()))
}

/// A workload whose events are posted.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Target {
    url: String,
    actor: String,
}

/// One event to post.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Delivery {
    workload: Uuid,
    url: String,
    actor: String,
    kind: String,
    id: Uuid,
    body: String,
    attempts: u32,
    first_at_ms: u64,
    next_at_ms: u64,
}

/// How a workload's notifications stand.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Status {
    /// Where they go: the URL's scheme and host only (its path may hold a secret).
    pub to: String,
    /// Events delivered.
    pub delivered: u64,
    /// Events waiting to be delivered (a failed one waits for its next try).
    pub pending: u64,
    /// Tries that failed.
    pub failed_attempts: u64,
    /// Events given up.
    pub given_up: u64,
    /// The last answer's status, if one came.
    pub last_status: Option<u16>,
    /// Why the last try failed, if it did.
    pub last_error: Option<String>,
    /// When the last try was, milliseconds since the epoch.
    pub last_attempt_at_ms: Option<u64>,
}

/// Keys of the notifier's tree.
const CURSOR: &[u8] = b"c";

fn target_key(w: Uuid) -> Vec<u8> {
    [b"t".as_slice(), w.as_bytes()].concat()
}

fn status_key(w: Uuid) -> Vec<u8> {
    [b"s".as_slice(), w.as_bytes()].concat()
}

fn delivery_key(seq: u64) -> Vec<u8> {
    [b"q".as_slice(), &seq.to_be_bytes()].concat()
}

/// The notifier of one ledger.
pub struct Notifier {
    _db: sled::Db,
    tree: sled::Tree,
    key: [u8; 32],
    wake: tokio::sync::Notify,
    http: ureq::Agent,
}

type Failed = String;

impl Notifier {
    /// Opens the notifier's store in `dir` with the service's `key`.
    pub fn open(dir: &Path, key: [u8; 32]) -> Result<Arc<Self>, String> {
        let db =
            eventlog::embedded::open_sled(sled::Config::new().path(dir).cache_capacity(8 << 20))
                .map_err(|e| format!("cannot open {}: {e}", dir.display()))?;
        let tree = db
            .open_tree("notify")
            .map_err(|e| format!("cannot open {}: {e}", dir.display()))?;
        let http = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0)
            .timeout_global(Some(POST_TIMEOUT))
            .user_agent("fairledger")
            .build()
            .into();
        Ok(Arc::new(Notifier {
            _db: db,
            tree,
            key,
            wake: tokio::sync::Notify::new(),
            http,
        }))
    }

    /// The service's key.
    pub fn key(&self) -> &[u8; 32] {
        &self.key
    }

    /// How `workload`'s notifications stand, if it has any.
    pub fn status(&self, workload: Uuid) -> Option<Status> {
        self.get(&status_key(workload))
    }

    fn get<T: serde::de::DeserializeOwned>(&self, key: &[u8]) -> Option<T> {
        let v = self.tree.get(key).ok()??;
        serde_json::from_slice(&v).ok()
    }

    fn cursor(&self) -> Option<u64> {
        let v = self.tree.get(CURSOR).ok()??;
        Some(u64::from_be_bytes(v.as_ref().try_into().ok()?))
    }

    /// Follows the log and queues the deliveries its events call for, until `stop`.
    pub async fn follow(self: Arc<Self>, app: App, stop: impl std::future::Future<Output = ()>) {
        let mut stop = std::pin::pin!(stop);
        // A new notifier owes nothing from before it: it starts at the log's end.
        let from = match self.cursor() {
            Some(c) => c + 1,
            None => match app.log().last_seq().await {
                Ok(last) => {
                    let _ = self.tree.insert(CURSOR, &last.to_be_bytes());
                    last + 1
                }
                Err(e) => {
                    tracing::error!(error = %e, "notifications: cannot read the log");
                    return;
                }
            },
        };
        let mut next = from;
        loop {
            let mut events = match app.log().subscribe(next).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "notifications: cannot follow the log; trying again");
                    tokio::select! {
                        _ = &mut stop => return,
                        _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    }
                }
            };
            loop {
                use futures::StreamExt;
                let item = tokio::select! {
                    _ = &mut stop => return,
                    item = events.next() => item,
                };
                match item {
                    Some(Ok(stored)) => {
                        if let Ok(env) = projector::decode(&stored.payload) {
                            if let Err(e) = self.take(&app, stored.seq, &env).await {
                                tracing::error!(error = %e, "notifications: cannot keep what is owed");
                            }
                        } else {
                            let _ = self.tree.insert(CURSOR, &stored.seq.to_be_bytes());
                        }
                        next = stored.seq + 1;
                    }
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, "notifications: the log's subscription failed; following again");
                        break;
                    }
                    None => break,
                }
            }
        }
    }

    /// Queues what the event at `seq` calls for, and moves the cursor past it, at once.
    async fn take(&self, app: &App, seq: u64, env: &Envelope) -> Result<(), String> {
        let mut batch = sled::Batch::default();
        batch.insert(CURSOR, &seq.to_be_bytes());
        match &env.event {
            Event::WorkloadSubmitted(e) => {
                let url = match &e.notify {
                    Some(url) => Some(url.clone()),
                    None => {
                        let p = app.inner.projection.read().await;
                        let url = p
                            .state()
                            .principals()
                            .by_actor(&env.actor)
                            .and_then(|p| p.notify.clone());
                        url
                    }
                };
                if let Some(url) = url {
                    let target = Target {
                        url,
                        actor: env.actor.clone(),
                    };
                    batch.insert(
                        target_key(e.workload),
                        serde_json::to_vec(&target).expect("targets serialize"),
                    );
                }
            }
            event if ledger::notify::posted(event) => {
                let Some(w) = event.workload() else {
                    return self.apply(batch);
                };
                let Some(target) = self.get::<Target>(&target_key(w)) else {
                    return self.apply(batch);
                };
                let body = serde_json::json!({
                    "delivery": env.id,
                    "seq": seq,
                    "type": event.kind(),
                    "workload": w,
                    "occurred_at": crate::period::date(env.occurred_at_ms),
                    "event": env,
                });
                let now = app.now_ms();
                let delivery = Delivery {
                    workload: w,
                    url: target.url.clone(),
                    actor: target.actor,
                    kind: event.kind().to_owned(),
                    id: env.id,
                    body: body.to_string(),
                    attempts: 0,
                    first_at_ms: now,
                    next_at_ms: now,
                };
                batch.insert(
                    delivery_key(seq),
                    serde_json::to_vec(&delivery).expect("deliveries serialize"),
                );
                let mut status: Status = self.get(&status_key(w)).unwrap_or_default();
                status.to = ledger::notify::origin(&target.url).to_owned();
                status.pending += 1;
                batch.insert(
                    status_key(w),
                    serde_json::to_vec(&status).expect("statuses serialize"),
                );
                if ledger::notify::last(event) {
                    batch.remove(target_key(w));
                }
            }
            _ => {}
        }
        self.apply(batch)?;
        self.wake.notify_one();
        Ok(())
    }

    fn apply(&self, batch: sled::Batch) -> Result<(), String> {
        self.tree.apply_batch(batch).map_err(|e| e.to_string())
    }

    /// Posts what is due, each workload's oldest first, until `stop`.
    pub async fn deliver(self: Arc<Self>, app: App, stop: impl std::future::Future<Output = ()>) {
        let mut stop = std::pin::pin!(stop);
        let mut flying: HashSet<Uuid> = HashSet::new();
        let mut posts = tokio::task::JoinSet::new();
        loop {
            let now = app.now_ms();
            // Each workload's oldest delivery; those due and not in flight go.
            let mut heads: BTreeMap<Uuid, (u64, Delivery)> = BTreeMap::new();
            for (k, v) in self.tree.scan_prefix(b"q").flatten() {
                let Ok(d) = serde_json::from_slice::<Delivery>(&v) else {
                    continue;
                };
                let seq = u64::from_be_bytes(k[1..].try_into().unwrap_or_default());
                heads.entry(d.workload).or_insert((seq, d));
            }
            for (w, (seq, d)) in heads {
                if flying.len() >= IN_FLIGHT {
                    break;
                }
                if d.next_at_ms > now || flying.contains(&w) {
                    continue;
                }
                let secret = {
                    let p = app.inner.projection.read().await;
                    let secret = p
                        .state()
                        .principals()
                        .by_actor(&d.actor)
                        .map(|p| secret(&self.key, p));
                    secret
                };
                flying.insert(w);
                let http = self.http.clone();
                posts.spawn(async move {
                    let answer = match secret {
                        None => Err(format!(
                            "its submitter {} no longer holds a grant, so nothing is signed for it",
                            d.actor
                        )),
                        Some(secret) => post(http, &d, &secret).await,
                    };
                    (seq, d, answer)
                });
            }
            tokio::select! {
                _ = &mut stop => return,
                _ = self.wake.notified() => {}
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                Some(Ok((seq, d, answer))) = posts.join_next(), if !posts.is_empty() => {
                    flying.remove(&d.workload);
                    if let Err(e) = self.record(seq, d, answer, app.now_ms()) {
                        tracing::error!(error = %e, "notifications: cannot record a delivery");
                    }
                }
            }
        }
    }

    /// Records how the delivery at `seq` went, at `now` (milliseconds since the epoch).
    fn record(
        &self,
        seq: u64,
        mut d: Delivery,
        answer: Result<u16, Failed>,
        now: u64,
    ) -> Result<(), String> {
        let mut status: Status = self.get(&status_key(d.workload)).unwrap_or_default();
        status.last_attempt_at_ms = Some(now);
        let mut batch = sled::Batch::default();
        match answer {
            Ok(code) if (200..300).contains(&code) => {
                status.last_status = Some(code);
                status.last_error = None;
                status.delivered += 1;
                status.pending = status.pending.saturating_sub(1);
                batch.remove(delivery_key(seq));
            }
            other => {
                let why = match other {
                    Ok(code) => {
                        status.last_status = Some(code);
                        format!("answered {code}")
                    }
                    Err(e) => e,
                };
                status.failed_attempts += 1;
                d.attempts += 1;
                let gone = now.saturating_sub(d.first_at_ms) >= GIVE_UP_AFTER_MS;
                if gone || why.contains("no longer holds a grant") {
                    status.given_up += 1;
                    status.pending = status.pending.saturating_sub(1);
                    status.last_error = Some(format!("{why}; gave up"));
                    tracing::warn!(workload = %d.workload, kind = %d.kind, "notifications: gave up a delivery: {why}");
                    batch.remove(delivery_key(seq));
                } else {
                    let wait = (1000u64 << (d.attempts - 1).min(20)).min(BACKOFF_MAX_MS);
                    d.next_at_ms = now + wait;
                    status.last_error =
                        Some(format!("{why}; trying again in {} s", wait.div_ceil(1000)));
                    batch.insert(
                        delivery_key(seq),
                        serde_json::to_vec(&d).expect("deliveries serialize"),
                    );
                }
            }
        }
        batch.insert(
            status_key(d.workload),
            serde_json::to_vec(&status).expect("statuses serialize"),
        );
        self.apply(batch)
    }
}

/// Posts `d` signed with `secret`: the answer's status, or why none came.
async fn post(http: ureq::Agent, d: &Delivery, secret: &str) -> Result<u16, Failed> {
    let (url, body, kind, id) = (d.url.clone(), d.body.clone(), d.kind.clone(), d.id);
    let signed = signature(secret, body.as_bytes());
    tokio::task::spawn_blocking(move || {
        let response = http
            .post(&url)
            .header("content-type", "application/json")
            .header("x-fairledger-event", &kind)
            .header("x-fairledger-delivery", id.to_string())
            .header("x-fairledger-signature-256", &signed)
            .send(body.as_bytes());
        match response {
            Ok(r) => Ok(r.status().as_u16()),
            Err(e) => Err(format!(
                "cannot reach {}: {e}",
                ledger::notify::origin(&url)
            )),
        }
    })
    .await
    .map_err(|e| e.to_string())?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_is_hmac_sha256_of_the_body_as_github_writes_it() {
        // RFC 4231 test case 2: key "Jefe", data "what do ya want for nothing?".
        assert_eq!(
            signature("Jefe", b"what do ya want for nothing?"),
            "sha256=5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn a_key_is_made_once_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify.key");
        let made = load_or_make_key(&path).unwrap();
        assert_eq!(load_or_make_key(&path).unwrap(), made);
        std::fs::write(&path, "short").unwrap();
        assert!(load_or_make_key(&path)
            .unwrap_err()
            .contains("64 hex digits"));
    }
}
