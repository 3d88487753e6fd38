//! The scheduler's lease in a JetStream key-value bucket: only the holder decides. The bucket's
//! entries age out after the lease's time to live, so a holder that stops renewing (crashed,
//! partitioned) loses it and another scheduler takes over; a renewal is a compare-and-set on the
//! revision the holder last wrote, so two processes never both believe they hold it for long.
//! Correctness does not rest on the lease — every decision is fenced by the sequence it was made
//! on — but with it the other schedulers stand by instead of racing.

use std::time::Duration;

use async_nats::jetstream::{self, kv};
use bytes::Bytes;

/// The bucket holding the lease.
pub const BUCKET: &str = "fairledger_scheduler";
const KEY: &str = "leader";

/// One process's claim on the scheduler lease.
pub struct Lease {
    kv: kv::Store,
    holder: Bytes,
    revision: Option<u64>,
}

impl Lease {
    /// Opens (creating if needed) the lease bucket with entries that live `ttl`, for `holder`.
    pub async fn open(
        js: &jetstream::Context,
        holder: &str,
        ttl: Duration,
        replicas: usize,
    ) -> Result<Self, String> {
        let kv = match js.get_key_value(BUCKET).await {
            Ok(kv) => kv,
            Err(_) => js
                .create_key_value(kv::Config {
                    bucket: BUCKET.into(),
                    description: "fairledger: which scheduler decides".into(),
                    history: 1,
                    max_age: ttl,
                    num_replicas: replicas,
                    ..Default::default()
                })
                .await
                .map_err(|e| format!("cannot create the lease bucket {BUCKET}: {e}"))?,
        };
        Ok(Lease {
            kv,
            holder: Bytes::from(holder.to_owned()),
            revision: None,
        })
    }

    /// Renews the lease if this process holds it, or takes it if nobody does. True while this
    /// process holds it; call it more often than the time to live.
    pub async fn hold(&mut self) -> bool {
        if let Some(revision) = self.revision {
            match self.kv.update(KEY, self.holder.clone(), revision).await {
                Ok(next) => {
                    self.revision = Some(next);
                    return true;
                }
                Err(_) => self.revision = None,
            }
        }
        match self.kv.create(KEY, self.holder.clone()).await {
            Ok(revision) => {
                self.revision = Some(revision);
                true
            }
            Err(_) => false,
        }
    }

    /// Who holds the lease now, if anyone.
    pub async fn holder(&self) -> Option<String> {
        let entry = self.kv.entry(KEY).await.ok().flatten()?;
        matches!(entry.operation, kv::Operation::Put)
            .then(|| String::from_utf8_lossy(&entry.value).into_owned())
    }
}
