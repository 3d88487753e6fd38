//! Leases in a JetStream key-value bucket: one holder per key at a time. The bucket's entries age
//! out after the lease's time to live, so a holder that stops renewing (crashed, partitioned)
//! loses it and another process takes over; a renewal is a compare-and-set on the revision the
//! holder last wrote, so two processes never both believe they hold it for long. The scheduler
//! holds one (only the holder decides; every decision is fenced by its sequence all the same),
//! and each node agent holds its node's name (two agents never drive one node).

use std::time::Duration;

use async_nats::jetstream::{self, kv};
use bytes::Bytes;

/// The bucket in which each node agent holds its node's name.
pub const AGENTS_BUCKET: &str = "fairledger_agents";

/// How long an agent's claim on its node outlives its last renewal, when the service creates
/// [`AGENTS_BUCKET`] (agents renew three times as often).
pub const AGENTS_TTL: Duration = Duration::from_secs(6);

/// Creates `bucket`, whose entries live `ttl`, unless it exists: for buckets that the
/// processes holding leases in it may not create (node agents with credentials of their own).
pub async fn ensure_bucket(
    js: &jetstream::Context,
    bucket: &str,
    ttl: Duration,
    replicas: usize,
) -> Result<(), String> {
    if js.get_key_value(bucket).await.is_ok() {
        return Ok(());
    }
    js.create_key_value(config(bucket, ttl, replicas))
        .await
        .map(|_| ())
        .map_err(|e| format!("cannot create the lease bucket {bucket}: {e}"))
}

fn config(bucket: &str, ttl: Duration, replicas: usize) -> kv::Config {
    kv::Config {
        bucket: bucket.into(),
        description: "fairledger: leases".into(),
        history: 1,
        max_age: ttl,
        num_replicas: replicas,
        ..Default::default()
    }
}

/// One process's claim on a lease (the scheduler's, or an agent's on its node).
pub struct Lease {
    kv: kv::Store,
    key: String,
    holder: Bytes,
    revision: Option<u64>,
}

impl Lease {
    /// Opens (creating if needed) `bucket`, whose entries live `ttl`, for `holder` to claim
    /// `key`. `holder` must be unique to this process (its claim is recognised by it).
    pub async fn open(
        js: &jetstream::Context,
        bucket: &str,
        key: &str,
        holder: &str,
        ttl: Duration,
        replicas: usize,
    ) -> Result<Self, String> {
        let valid = !key.is_empty()
            && key
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_=./".contains(c))
            && !key.starts_with('.')
            && !key.ends_with('.');
        if !valid {
            return Err(format!(
                "{key:?} cannot name a lease: use letters, digits and - _ = . /"
            ));
        }
        let kv = match js.get_key_value(bucket).await {
            Ok(kv) => kv,
            Err(_) => js
                .create_key_value(config(bucket, ttl, replicas))
                .await
                .map_err(|e| format!("cannot create the lease bucket {bucket}: {e}"))?,
        };
        Ok(Lease {
            kv,
            key: key.to_owned(),
            holder: Bytes::from(holder.to_owned()),
            revision: None,
        })
    }

    /// Renews the lease if this process holds it, or takes it if nobody does. True while this
    /// process holds it; call it more often than the time to live.
    pub async fn hold(&mut self) -> bool {
        if let Some(revision) = self.revision {
            match self
                .kv
                .update(&self.key, self.holder.clone(), revision)
                .await
            {
                Ok(next) => {
                    self.revision = Some(next);
                    return true;
                }
                Err(_) => self.revision = None,
            }
        }
        match self.kv.create(&self.key, self.holder.clone()).await {
            Ok(revision) => {
                self.revision = Some(revision);
                true
            }
            Err(_) => self.reclaim().await,
        }
    }

    /// Carries on with a claim that is still this holder's although its revision was lost (an
    /// update that landed without its answer, as in a cluster's failover): without this the
    /// holder would stand by, locked out by its own claim until it aged out.
    async fn reclaim(&mut self) -> bool {
        let Ok(Some(entry)) = self.kv.entry(&self.key).await else {
            return false;
        };
        if entry.operation != kv::Operation::Put || entry.value != self.holder {
            return false;
        }
        match self
            .kv
            .update(&self.key, self.holder.clone(), entry.revision)
            .await
        {
            Ok(revision) => {
                self.revision = Some(revision);
                true
            }
            Err(_) => false,
        }
    }

    /// Takes the lease from `dead`, a holder known to have stopped (a crashed process on this
    /// machine), without waiting for its claim to age out: a compare-and-set on the revision
    /// `dead` last wrote, so a holder that renewed meanwhile keeps it. True if taken.
    pub async fn take_from(&mut self, dead: &str) -> bool {
        let Ok(Some(entry)) = self.kv.entry(&self.key).await else {
            return false;
        };
        if entry.operation != kv::Operation::Put || entry.value != dead.as_bytes() {
            return false;
        }
        match self
            .kv
            .update(&self.key, self.holder.clone(), entry.revision)
            .await
        {
            Ok(revision) => {
                self.revision = Some(revision);
                true
            }
            Err(_) => false,
        }
    }

    /// How long a claim outlives its last renewal: the bucket's, which whoever created it chose.
    pub async fn ttl(&self) -> Result<Duration, String> {
        self.kv
            .status()
            .await
            .map(|s| s.max_age())
            .map_err(|e| format!("cannot read the lease bucket: {e}"))
    }

    /// Who holds the lease now, if anyone.
    pub async fn holder(&self) -> Option<String> {
        let entry = self.kv.entry(&self.key).await.ok().flatten()?;
        matches!(entry.operation, kv::Operation::Put)
            .then(|| String::from_utf8_lossy(&entry.value).into_owned())
    }
}
