//! Per-principal rates: a token bucket for each principal and each kind of costly request
//! (submissions, what-ifs, history replays), so that no principal below an admin can take the
//! service's time from the others. The rates are the grant's ([`Principal::rate`]); the buckets
//! live in each API process.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use ledger::identity::{Principal, RateKind};

use crate::Problem;

/// The buckets of every principal that has used one.
#[derive(Default)]
pub(crate) struct Limiter {
    buckets: Mutex<HashMap<(String, RateKind), Bucket>>,
}

struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Limiter {
    /// Takes one turn of `kind` for `principal`: a 429 with `Retry-After` when its rate has none
    /// left. A bucket holds ten seconds' worth (at least one), refilled at the rate.
    pub(crate) fn take(&self, principal: &Principal, kind: RateKind) -> Result<(), Problem> {
        let Some(per_minute) = principal.rate(kind) else {
            return Ok(());
        };
        let per_s = f64::from(per_minute) / 60.0;
        let capacity = (per_s * 10.0).max(1.0);
        let now = Instant::now();
        let mut buckets = self.buckets.lock().expect("never poisoned");
        let bucket = buckets
            .entry((principal.name.clone(), kind))
            .or_insert(Bucket {
                tokens: capacity,
                at: now,
            });
        bucket.tokens =
            (bucket.tokens + now.duration_since(bucket.at).as_secs_f64() * per_s).min(capacity);
        bucket.at = now;
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            return Ok(());
        }
        let wait_s = if per_s > 0.0 {
            ((1.0 - bucket.tokens) / per_s).ceil().max(1.0) as u64
        } else {
            3_600
        };
        Err(Problem::rate_limited(
            format!(
                "{} may make {per_minute} {} a minute and has made them; try again in {wait_s} s, or ask an admin to raise its rate",
                principal.actor(),
                kind.name()
            ),
            wait_s,
        ))
    }
}
